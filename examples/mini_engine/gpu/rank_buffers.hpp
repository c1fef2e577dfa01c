#pragma once

// Every per-rank device buffer of the GPU runtime (weights outside the arena, activations,
// step inputs, expert and attention workspaces) at a fixed offset in ONE allocation per rank,
// in the style of DeepEP's WorkspaceLayout: the sizes are known at construction (the model,
// P, max_tokens, the largest expert shape of any bucket), so one buffer serves every bucket
// and mode, and the graphs captured over it keep their addresses for the runtime's life.
// The expert arena and the KV pool are not in it: they are Moebius's memory (memory() hands
// them to a transport, which may export each as a whole allocation), one cudaMalloc each.
//
// Host arithmetic only. Regions lie in the order the runtime allocated them before (one
// cudaMalloc each), each `alignment` bytes aligned (cudaMalloc's guarantee, so every kernel
// and cuBLAS sees pointers aligned as they were) and at least one element long.
//   hidden 64, max_tokens 32: h = [32, 64] fp32 = 8192 bytes at some multiple of 256.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mini_engine::gpu {

// What the layout needs to know (the runtime's setup computes it).
struct rank_buffer_sizes {
  int64_t num_layers = 0, hidden = 0, head_dim = 0, q_dim = 0;  // L, H, D, Hq D
  int64_t qkv_rows = 0;  // (Hq + 2 Hkv) D: fused q/k/v weight rows
  int64_t num_experts = 0, top_k = 0, vocab = 0;
  int64_t dense_bytes = 4;              // bytes per dense-weight element
  int64_t expert_bytes = 4;             // bytes per element of the expert GEMMs' inputs
  int64_t max_tokens = 0;               // T: rows per rank per step
  int64_t gathered_rows = 0;            // G = P T: rows after the dispatch all-gather
  int64_t packed_row_bytes = 0;         // moe_token_layout(...).row_bytes
  int64_t input_count = 0;              // int32 entries of one input block
  int64_t max_pairs = 0;                // G top_k
  int64_t max_rows = 0, max_tiles = 0;  // expert tiles: rows of all tiles, tiles
  int64_t max_inter = 0;                // I (EP; TP needs I/P)
  int64_t sort_temp_bytes = 0;          // CUB radix sort
  int64_t attention_floats = 0;         // paged_attention_workspace_floats, worst case
  int64_t dequant_w13_bytes = 0, dequant_w2_bytes = 0;  // fp8 scratch (0: none)
  int64_t cublas_workspace_bytes = 0;
  // Virtual ranks' all-reduce: the sum of the ranks' buffers before it is copied back (T H
  // floats; 0: none, one rank per device).
  int64_t reduce_scratch_floats = 0;
  // Decode context parallelism (gpu_runtime_options::dcp > 1): the DCP set's q heads gathered,
  // and this rank's partial attention over them ([T, dcp Hq/P D] floats each), and its LSEs
  // ([T, dcp Hq/P]). 0: none.
  int64_t dcp_head_floats = 0;
  int64_t dcp_lse_floats = 0;
};

// One buffer inside the allocation: [offset, offset + bytes).
struct buffer_region {
  int64_t offset = 0;
  int64_t bytes = 0;
  template <class T>
  T* in(std::byte* base) const {
    return reinterpret_cast<T*>(base + offset);
  }
};

struct rank_buffer_layout {
  static constexpr int64_t alignment = 256;

  buffer_region cublas_workspace;
  struct layer_regions {
    buffer_region qkv;             // [(Hq + 2 Hkv) D, H] dense dtype
    buffer_region o;               // [H, Hq D] dense dtype
    buffer_region router;          // [E, H] fp32
    buffer_region ln1, ln2;        // [H] fp32
    buffer_region q_norm, k_norm;  // [D] fp32
  };
  std::vector<layer_regions> layers;  // [L]
  buffer_region embed;                // [V, H] dense dtype
  buffer_region final_norm;           // [H] fp32
  buffer_region lm_head;              // [V, H] dense dtype
  // Activations (T rows per rank, G gathered).
  buffer_region h, xn;          // [T, H] fp32
  buffer_region xd;             // [T, max(H, Hq D)] dense dtype
  buffer_region qkv;            // [T, (Hq + 2 Hkv) D] fp32
  buffer_region attn;           // [T, Hq D] fp32
  buffer_region proj;           // [T, H] fp32
  buffer_region router_logits;  // [T, E] fp32
  buffer_region topk_ids;       // [T, k] int32
  buffer_region topk_w;         // [T, k] fp32
  buffer_region packed;         // [T] packed rows
  buffer_region gathered;       // [G] packed rows
  buffer_region moe_out;        // [G, H] fp32
  buffer_region recv;           // [G, H] fp32
  buffer_region logits;         // [T, V] fp32
  buffer_region next;           // [T] int32
  buffer_region next_value;     // [T] fp32
  buffer_region inputs[2];      // [input_count] int32, one per attention mode
  // Expert workspace (moe_plan).
  buffer_region keys, values, keys_sorted, values_sorted;        // [G k] int32
  buffer_region expert_info;                                     // [3 E + 1] int32
  buffer_region pair_row;                                        // [G k] int32
  buffer_region x_perm;                                          // [rows, H] expert dtype
  buffer_region gu;                                              // [rows, 2 I] fp32
  buffer_region act;                                             // [rows, I] expert dtype
  buffer_region y;                                               // [rows, H] fp32
  buffer_region ptr_w13, ptr_x, ptr_gu, ptr_w2, ptr_act, ptr_y;  // [tiles] pointers
  buffer_region sort_temp;                                       // CUB temp storage
  buffer_region overflow;                                        // [1] int32
  buffer_region dequant_w13, dequant_w2;                         // fp8 scratch (absent: bytes 0)
  buffer_region attention_workspace;                             // [floats] fp32
  buffer_region reduce_scratch;  // [T H] fp32, virtual ranks' all-reduce (absent: bytes 0)
  // dcp > 1 (absent: bytes 0): the set's q, this rank's partial outputs, their LSEs (fp32).
  buffer_region dcp_q, dcp_out;  // [dcp_head_floats]
  buffer_region dcp_lse;         // [dcp_lse_floats]

  int64_t total_bytes = 0;
  int64_t num_bytes() const { return total_bytes; }
};

// The layout of `s`: every region placed in turn, aligned, none overlapping.
rank_buffer_layout make_rank_buffer_layout(const rank_buffer_sizes& s);

}  // namespace mini_engine::gpu
