#pragma once

// The stage profile (gpu_runtime_options::profile, MINI_ENGINE_PROFILE=1): steps run eagerly
// and every rank's stream records a CUDA event at each stage boundary; the intervals are
// summed per stage over the step, and the step's figure per stage is its longest rank.
// Off, nothing is recorded (the marks return at once) and graphs replay as usual: nothing is
// captured differently.

#include <cuda_runtime.h>

#include <cstddef>
#include <span>
#include <vector>

namespace mini_engine::gpu {

enum stage : int {
  st_upload,       // step inputs host -> device
  st_embed,        // embedding
  st_qkv,          // input norm, q/k/v GEMMs, q/k norms, RoPE, KV append
  st_attention,    // paged attention (and the split kernel's merge)
  st_o_proj,       // o_proj GEMM (and its input conversion)
  st_router,       // residual add, post-attention norm, router GEMM, top-k, pack
  st_permute,      // route, sort, tile map, gather
  st_dequant,      // fp8 experts: the touched experts expanded into the scratch
  st_experts,      // expert GEMMs and SiLU-and-mul
  st_combine,      // moe_combine, residual adds, local copies
  st_collectives,  // NCCL: all-reduces, dispatch all-gather, combine send/recv, hand-off
  st_hand_off,     // hybrid steps: row gathers at a mode change
  st_lm_head,      // final norm, LM-head GEMM, argmax
  st_download,     // next tokens device -> host
  st_count
};
inline constexpr const char* stage_names[st_count] = {
    "upload",  "embed",   "qkv",     "attention",   "o_proj",   "router",  "permute",
    "dequant", "experts", "combine", "collectives", "hand_off", "lm_head", "download"};

// One rank's marks in the current step: events created as needed (on the current device, the
// rank's) and kept for the next steps, and the stage of the interval each one ends (-1: the
// start).
struct stage_marks {
  std::vector<cudaEvent_t> events;
  std::vector<int> stage;
  size_t used = 0;

  // Ends the current interval on `stream` as stage `st` (-1: starts the step).
  void record(cudaStream_t stream, int st);
  // After the stream is synchronised: the intervals summed per stage (seconds); starts over.
  std::vector<double> collect();
  // Destroys the events (on the rank's device).
  void release();
};

// The longest rank per stage: the step's stage times (seconds, st_count of them).
std::vector<double> stage_times_of(std::span<stage_marks* const> ranks);

}  // namespace mini_engine::gpu
