#pragma once

// What SGLang's prefill-first steps cost each mode's decodes, for the cost gate
// (run_policy's curve correction). Without mixed chunks an SGLang scheduler runs a prefill
// whenever one can be formed and its decoding requests sit that step out
// (step_batch::decodes_held); the step's time is spent and their tokens are not made. The gate
// prices a mode by its decode curve, so a mode whose decodes are held a share s of its time
// makes each decode token 1 / (1 - s) times as slow as its curve says. TP runs one scheduler
// and a prefill holds every decode; data-parallel attention (EP) runs one per rank and a
// prefill holds only its rank's. On the steady paper trace under SGLang (39.3 requests/s) static
// TP's decodes were held 74% of the decode slots and 51% of the time (steps from 100 to 300 s);
// static EP's 35% and 36%: a TP decode token cost 2.05x its curve, an EP one 1.56x.
//
// vLLM and SGLang with mixed chunks never hold a decode: every factor is 1.
//
// And what a prefill costs an EP step that TP's steps do not show (ep_prefill_slowdown): under
// data-parallel attention a chunk runs on its owner rank alone, and the step waits for it.
// SGLang divides its chunk by the DP size, so at most 1,024 rows of a step's prefill sit on one
// rank of 8. Priced as if the whole prefill sat on one rank, the production-shaped trace at
// 7.9 requests/s under SGLang (TP's recent steps: 33-250 decode and 650-2,850 prefill rows)
// made EP's steps 3-5.5x TP's and kept the paper's design in TP, TTFT p99 3.2x static EP's.

#include <cstdint>

#include <moebius/policy/calibration.hpp>

#include "dcp_capacity.hpp"  // recent_mean

namespace mini_engine {

// One mode's recent steps (exponential means of weight 1/512 a step: the share is a property
// of the arrivals sustained over tens of seconds, 512 steps being 25-60 s of serving at the
// paper's scale; a flood of a few seconds, ~100-150 TP steps of prefills, moves it little. At
// recent_mean's 1/64 the paper design's SGLang run went to EP at the bursty trace's first
// flood, where EP's per-rank chunks prefill slower: flood TTFT p99 0.26 s against static
// TP's 0.15).
class prefill_stalls {
 public:
  static constexpr double k_weight = 1.0 / 512;
  // A step outside a switch: its time, the decodes it made and those a prefill held. Throws
  // errc::invalid_argument for a negative or non-finite step_ms or a negative count.
  void add(double step_ms, int64_t decode_tokens, int64_t decodes_held);
  bool seen() const { return time_.seen(); }
  // The share of the decode slots held: held / (held + decoded), 0 when neither.
  double held_share() const;
  // The share of the time the held decodes lost, each step's time split over its decode slots
  // (a step that holds 1 of 8 ranks' decodes loses 1/8 of its time).
  double lost_share() const;

 private:
  recent_mean time_{k_weight}, lost_{k_weight}, decoded_{k_weight}, held_{k_weight};
};

// The factor by which a mode's decode tokens are slower than its curve: 1 / (1 - lost_share),
// the share capped at k_max_lost_share (a mode that held every decode would be priced
// infinitely slow, where the prefills it ran end and it decodes again).
inline constexpr double k_max_lost_share = 0.9;
double stall_factor(double lost_share);

// The mode not serving, from the one serving: the lost share of the unseen mode's `unseen_groups`
// schedulers (TP 1, data-parallel attention P) from the seen mode's `seen_groups`. A group runs
// a prefill whenever a request arrived for it since its last step: with arrivals at random
// (Poisson), the seen held share q_s gives a_s = -ln(1 - q_s) arrivals a group a step; the
// unseen groups each see a_s x seen_groups / unseen_groups (steps taken as long), hold a share
// q_u = 1 - exp(-a_u) of their decodes, and lose the seen mode's lost time per held slot,
// lost_u = lost_s x q_u / q_s. Equal groups: the seen share (under TP attention in both modes
// every rank runs every prefill). Worked example (the steady trace above, from static TP):
// q_s 0.743, lost_s 0.513, 1 -> 8 groups: a_s 1.359, a_u 0.170, q_u 0.156, lost_u 0.108 (EP
// measured 0.357: the TP scheduler's batch cap keeps q_s under what its arrivals alone give, so
// the estimate from TP favours EP; from EP it would price TP near the cap). The gate takes it
// for the mode not serving, always from the serving mode's recent steps (a measurement of an
// earlier stint saw other arrivals). Throws errc::invalid_argument for shares outside [0, 1]
// or a group count < 1.
double unseen_lost_share(double seen_held_share, double seen_lost_share, int64_t seen_groups,
                         int64_t unseen_groups);

// How many times TP's an EP step (data-parallel attention over `ranks` ranks) takes at the same
// decode rows `b` and prefill rows `pf` a step: the gate's estimate for the mode not seen yet.
// An EP step is its busiest rank's, and a chunk runs on its owner alone where TP spreads it
// over every rank; a rank runs at most `rank_chunk` prefill rows a step
// (scheduler_options::rank_prefill_chunk), the rest run on other ranks beside it. So EP's
// curve at b + ranks * max(pf / ranks, min(pf, rank_chunk)) rows against b + pf:
//   ep 10 + 0.01 x ms, b 100, pf 2,000, 8 ranks: chunk 1,024 (sglang's 8,192 / 8)
//   92.92 / 31 = 2.997; chunk 8,192 (vLLM's budget) 171 / 31 = 5.516.
// Throws errc::invalid_argument for b < 1, pf < 0 or not finite, ranks < 1 or rank_chunk < 1.
double ep_prefill_slowdown(const moebius::latency_curve& ep, double b, double pf, int64_t ranks,
                           int64_t rank_chunk);

}  // namespace mini_engine
