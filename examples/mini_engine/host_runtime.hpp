#pragma once

// The mini-engine's host runtime: the whole model on P virtual ranks in one process, no GPU
// (CI and the CPU demo). Per rank an expert arena and a KV pool, both plain host memory that
// a moebius::host_transport (and so a moebius::switcher) moves between the EP and TP
// layouts; the runtime reads its experts only from the arena and its K/V only from the pool.
//
// Per layer (a hybrid step, step.hpp: the layer's mode is TP iff layer < cursor for both
// attention and MoE, with the activation hand-off at the boundary, see hand_off(); a static
// step: attention in the mode of its tables, the MoE by the cursor, in any combination):
//   attention, in the mode of the KV tables passed to step():
//     TP: rank r computes its Hq/P query heads [q0, q1) against the KV head slice
//         tp_slice_of_rank(r) (replicated on P/Hkv ranks when Hkv < P), and an o_proj
//         partial sum over its heads' columns; all-reduce. With the geometry's KV-parallel
//         degree dcp (kv_geometry.hpp; host_runtime_options::dcp) the ranks of a slice form
//         sets of dcp consecutive ranks, and rank r holds only its DCP share of each
//         sequence: a new token's K/V is stored on the ranks of DCP index
//         (position / page_size) % dcp of every set of its slice, nowhere else. The attention
//         over the whole sequence is then a merge of partial attentions. The runtime simulates
//         the exchange vLLM's decode context parallelism ships (its cp_lse_ag_out_rs), because
//         engines run it and it keeps TP's structure: the merged output of each head is still
//         formed and rounded on its own rank before o_proj, so the o_proj partials and their
//         all-reduce are TP's unchanged. (Helix computes QKV redundantly on every member and
//         swaps partials in one all-to-all: the same values here, more projection work there.
//         Folding the merge into o_proj's all-reduce skips forming the merged head output, a
//         rounding point dcp = 1 has, and still needs the LSEs all-gathered first.) Per set:
//           1. each rank computes Q of its heads; an all-gather within the DCP set gives
//              every member the Q of the set's heads (floats, copied: exact);
//           2. each member s attends all the set's q heads over the positions it holds
//              (causally: those <= the query's position), giving per (token, head) the partial
//              output o_s, normalised by its own softmax sum, and lse_s = max + log(sum), in
//              double (a member holding none of those positions gives lse_s = -inf, no part);
//           3. the LSEs are all-gathered, each member scales its o_s by exp(lse_s - lse),
//              lse = m + log(sum_s exp(lse_s - m)) with m = max_s lse_s (the log-sum-exp of
//              all parts), and a reduce-scatter over heads sums the scaled parts in DCP-index
//              order, leaving each rank its own heads: o = sum_s exp(lse_s - lse) * o_s, rounded
//              to float (the same rounding point as without dcp).
//         dcp = 1 is the same code with one part: m = lse_0, lse = lse_0 + log(1) = lse_0,
//         the weight exp(0) = 1 and o = o_0 exactly, so the float is what one softmax gives.
//     EP: each sequence runs whole (all heads) on its owner rank, over EP pages (one part).
//   MoE, in the mode of the layer in the arena (layers below the cursor TP, the rest EP):
//     TP: every rank runs its I/P slice of every routed expert (TP view, slot layer) and sums
//         its partials over the token's experts; all-reduce.
//     EP: each token is dispatched to the owners of its top-k experts (EP view, slot
//         layer+1), computed there, and combined back in top-k order.
// Norms, router and LM head are computed once per token (every rank would compute the same
// values). Collectives are simulated exactly: an all-reduce is the sum of the ranks'
// partials in rank order.
//
// Why a switch at any step leaves the greedy tokens unchanged (but for a near tie, below), and
// why every static layout gives the same tokens: every dot product and every
// cross-rank sum accumulates in double, and values are rounded to float (or to the KV dtype on
// store) at fixed points that are the same in every layout: after each projection's full sum,
// after each norm, after RoPE, after each head's attention output, after each expert's
// SiLU(gate)*up, after each all-reduce/combine, after each residual add. A product of two
// floats (24-bit significands) is exact in double (53), and so is an fp8 code times its
// power-of-two scale times a float; the loops that produce a row's dot product are the same
// code over the same bytes in every layout (a row of q/k/v, of w13 or of the router is whole on
// whichever rank computes it), so those values are bitwise identical. What differs between
// layouts is the order of some sums in double, never which terms are summed:
//   - the cross-rank sums (o_proj and the experts' down projection: partial sums per rank, then
//     over ranks, versus one sum): an error of about 1e-16 relative;
//   - with dcp > 1, the softmax: each part has its own max and sum, rescaled by exp and log of
//     the LSEs, versus one max and one sum over every position: a few 1e-16 relative.
// Such an error changes the float a value rounds to only when the exact value lies within that
// distance of a rounding boundary between two floats, and then by one float ulp (~6e-8
// relative): probability ~2^24 * 1e-16 ~ 2e-9 per value for a cross-rank sum, up to ~1e-8 per
// attention output with dcp > 1 (an LSE of magnitude ~10 carries ~1e-15 absolute error into
// exp). One flipped value then moves the logits by ~1e-7 relative or less. So:
//   - guaranteed: a layout computes the same bits from the same inputs (fixed loop orders);
//     dcp = 1 computes the bits it computed before dcp existed (the merge of one part is exact,
//     above); and every layout sums the same terms, so from equal inputs a rounded value
//     differs between layouts at most by its own rounding's flip;
//   - not guaranteed, and what one sees: bitwise equal K/V, attention and logits in every
//     layout, EP, TP, TP(dcp) with either experts (measured: 0 of 819,200 logits differ
//     between EP, TP and TP(dcp 4) on small() at P = 8, 8 sequences of up to 120 prompt tokens
//     and 24 decode steps, 4 models), so a run that switches gives the bits of one that never
//     does; a flip is a near-boundary value, not a wrong layout.
// The tests claim accordingly. The EP <-> TP switch tests (dcp = 1, fixed seeds) check bits,
// the long-standing contract of this runtime, which a flip on a new seed would make a value to
// look at; the tests of dcp > 1 and of the other layouts check what the guarantee bounds, with
// wide margin: logits within 1e-5 * max(1, |logit|) of each other (a few flips move them ~1e-7),
// and equal greedy tokens unless the top two logits lie within twice that of each other (a
// near tie, where the runs may part), and they print how many logits differ in bits.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <moebius/kv/kv_geometry.hpp>
#include <moebius/kv/kv_pool_layout.hpp>
#include <moebius/layout/arena_geometry.hpp>
#include <moebius/memory/deployment_memory.hpp>
#include <moebius/memory/rank_memory.hpp>
#include <span>
#include <vector>

#include "layer_schedule.hpp"
#include "model_config.hpp"
#include "step.hpp"
#include "weight_sink.hpp"
#include "weights.hpp"

namespace mini_engine {

struct host_runtime_options {
  int num_ranks = 1;
  int64_t num_ep_pages = 64;        // KV pages per rank in EP (TP: x tp_pages_per_ep_page)
  moebius::arena_cursor cursor{0};  // where the experts are placed initially (0: EP, L: TP)
  int64_t tensor_alignment = 256;   // arena layout (small slots keep host images small)
  int64_t slot_alignment = 4096;
  // How the KV pool lies (kv_pool_layout.hpp): attention reads and writes K/V through this
  // layout, so the runtime serves the cache of vLLM or SGLang as they lay it out (a preset
  // with packed buffers: the memory owner allocates kv_geometry::pool_bytes()). sglang_mha
  // needs an NHD geometry; present and the vLLM presets take either.
  moebius::kv_preset kv_preset = moebius::kv_preset::present;
  // KV-parallel degree of the TP view (kv_geometry::dcp): the ranks holding one KV head slice
  // split each sequence's pages in sets of dcp (attention merges their partial softmaxes,
  // above). 1: every TP rank holds every token of its heads. Must divide P/Hkv (Hkv < P), be 1
  // when Hkv >= P: the library's check (moebius::with_dcp) refuses any other value. The dcp
  // the runtime starts at: a step whose step_layout::dcp names another (after
  // switcher::plan_dcp committed it) moves the runtime to it, and kv() says it from then on.
  int64_t dcp = 1;
};

class host_runtime : public synchronous_runtime {
 public:
  // Validates the weights and the config over options.num_ranks, lays out the arena and the
  // KV pool, and places the experts at options.cursor. Keeps the non-expert weights; the
  // experts exist only in the arena from then on.
  host_runtime(const model_weights& weights, const host_runtime_options& options);
  // The model `config` with its weights streamed in by `load`, which must put every tensor
  // of the model into the sink it is given exactly once (hf_checkpoint::load does): each is
  // converted once, straight into its place (the experts into the arena at options.cursor
  // through place_expert_part, projections and the LM head into the runtime's double
  // buffers, norms and the embedding as float), with no float copy of the model in between.
  //   hf_checkpoint ck(dir);  model_config m = ck.config().model;
  //   host_runtime rt(m, o, [&](weight_sink& s) { ck.load(m, s); });
  // Throws what `load` throws (then no runtime exists), or errc::invalid_argument when a
  // tensor is missing or comes twice.
  host_runtime(const model_config& config, const host_runtime_options& options,
               const std::function<void(weight_sink&)>& load);

  int64_t vocab_size() const override { return weights_.config.vocab; }

  // Rank r's arena and KV pool, for a moebius::host_transport.
  std::vector<moebius::rank_memory> memory();
  // The library's owner of that memory (moebius::host_deployment_memory): typed views.
  const moebius::deployment_memory& deployment() const { return *memory_; }
  // The pool's layout (options.kv_preset), for switcher_options::kv_layout.
  const moebius::kv_pool_layout& kv_layout() const { return kv_layout_; }
  const moebius::arena_geometry& arena() const { return arena_geometry_; }
  const moebius::kv_geometry& kv() const { return kv_geometry_; }
  const model_config& config() const { return weights_.config; }
  int num_ranks() const { return arena_geometry_.num_ranks; }

  // Rewrites every layer's experts where `cursor` puts them (tests; a reload).
  void place_experts(const model_weights& weights, moebius::arena_cursor cursor);

 protected:
  // One forward step (step.hpp), computed when it is enqueued. Throws errc::invalid_argument,
  // before writing anything, when the tables are invalid, the cursor is outside [0, L], a token
  // is outside the vocab, or an item's sequence is not in the tables with room for its tokens.
  std::vector<int32_t> compute(const step_layout& layout, std::span<const step_item> items,
                               std::vector<std::vector<float>>* logits) override;

 private:
  struct token_ref {
    int64_t item;
    int64_t position;
  };
  void attention_ep(int64_t layer, const moebius::kv_state& tables,
                    std::span<const step_item> items);
  void attention_tp(int64_t layer, const moebius::kv_state& tables,
                    std::span<const step_item> items);
  // One rank's K/V of one sequence in one mode: the rank's pool and its page list. In TP with
  // dcp > 1 the rank holds only its DCP share of the positions (holds()).
  struct rank_kv {
    int rank = 0;
    moebius::parallel_mode mode = moebius::parallel_mode::ep;
    const moebius::kv_sequence* seq = nullptr;
  };
  bool holds(const rank_kv& kv, int64_t pos) const;
  // Where element 0 of (layer, K|V, global KV head, position) lies; the rank must hold both.
  std::byte* kv_at(const rank_kv& kv, int64_t layer, moebius::kv_tensor t, int64_t head,
                   int64_t pos) const;
  // K/V of the item's new tokens for global KV heads [kv0, kv1) (projection, k_norm, RoPE),
  // stored into the rank's pages where it holds the position.
  void store_new_kv(int64_t layer, const rank_kv& kv, int64_t item_index, const step_item& item,
                    int64_t kv0, int64_t kv1);
  // Q of the item's new tokens for q heads [q0, q1) (projection, q_norm, RoPE) into q_.
  void project_queries(int64_t layer, int64_t item_index, const step_item& item, int64_t q0,
                       int64_t q1);
  // Attention of q heads [q0, q1) of the item's new tokens over the positions `kv` holds
  // (causal), into part `part` of part_o_ (normalised by its own sum) and part_lse_.
  void partial_attention(int64_t layer, const rank_kv& kv, int64_t item_index,
                         const step_item& item, int64_t q0, int64_t q1, int64_t part);
  // o_ of q heads [q0, q1) of the item's new tokens: the LSE-weighted sum of parts
  // [0, num_parts), rounded to float.
  void merge_partials(int64_t item_index, const step_item& item, int64_t q0, int64_t q1,
                      int64_t num_parts);
  void hand_off(moebius::parallel_mode to, const token_layout& ep, const hand_off_maps& maps);
  void route(int64_t layer, int64_t T);
  void run_expert(int64_t layer, moebius::parallel_mode mode, int rank, int64_t e, int64_t i0,
                  int64_t i1);
  void moe_ep(int64_t layer, int64_t T);
  void moe_tp(int64_t layer, int64_t T);
  void add_residual(int64_t T);
  // Geometry, arenas, pools and RoPE of weights_.config over options (both constructors).
  void lay_out(const host_runtime_options& options);

  // The projections as double (exactly the float weights), so the dot products convert
  // nothing: [Hq*D, H], [Hkv*D, H] x2, [H, Hq*D], [E, H]; and the LM head [V, H].
  struct dense_layer {
    std::vector<double> q_proj, k_proj, v_proj, o_proj, router;
  };

  model_weights weights_;  // experts cleared: they live in the arena; norms used from here
  std::vector<dense_layer> dense_;
  std::vector<double> lm_head_;
  moebius::arena_geometry arena_geometry_;
  moebius::kv_geometry kv_geometry_;
  // Every rank's arena and KV pool, allocated once by the library's memory owner, zeroed.
  std::unique_ptr<moebius::host_deployment_memory> memory_;
  moebius::kv_pool_layout kv_layout_;
  std::byte* arena_of(int rank) const;
  std::byte* pool_of(int rank) const;
  std::vector<std::span<std::byte>> arena_spans() const;
  std::vector<double> inv_freq_;                // [D/2] RoPE frequencies

  // Per-step scratch, grown as needed (no allocation inside the loops).
  std::vector<token_ref> tokens_;     // [T] the batch's new tokens
  std::vector<int32_t> token_ids_;    // [T]
  std::vector<int64_t> item_first_;   // [items+1] first batch token of each item
  std::vector<double> cos_, sin_;     // [T, D/2] RoPE of each token's position
  std::vector<float> h_;              // [T, H] residual stream
  std::vector<float> rank_rows_;      // [P * rows, H] hand-off buffers of the P ranks
  std::vector<double> x_;             // [T, H] normed input of the current block (floats)
  std::vector<double> o_;             // [T, Hq*D] attention output per head (floats)
  std::vector<double> acc_;           // [T, H] block output: all-reduce / combine
  std::vector<int32_t> topk_expert_;  // [T, K]
  std::vector<double> topk_weight_;   // [T, K]
  std::vector<double> probs_;         // [E]
  std::vector<int64_t> expert_first_, expert_fill_;  // [E+1] pairs of each expert
  std::vector<int64_t> pairs_;                       // [T*K] pair t*K+k, grouped by expert
  std::vector<double> gate_;                         // [T*K, I] gate projections
  std::vector<double> act_;                          // [T*K, I] SiLU(gate)*up (floats)
  std::vector<double> y_;             // [T*K, H] expert outputs (EP: whole; TP: rank slice)
  std::vector<double> row_;           // a dequantized weight row
  std::vector<float> q_;              // [T, Hq*D] queries after q_norm and RoPE
  std::vector<double> part_o_;        // [parts, T, Hq*D] partial attention outputs
  std::vector<double> part_lse_;      // [parts, T, Hq] their log-sum-exps (-inf: empty)
  std::vector<int64_t> held_;         // [positions] the positions a rank holds, ascending
  std::vector<double> kbuf_, vbuf_;   // [positions, D] one head's K and V
  std::vector<float> qbuf_, kvtmp_;   // [2D], [D]
  std::vector<double> score_, accd_;  // [positions], [D]
};

}  // namespace mini_engine
