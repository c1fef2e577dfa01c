#pragma once

// Traces shaped like the paper's two experiments (Moebius §9.2 and §9.3; DESIGN.md §8), drawn
// from a seed at their full size. Every parameter below names its source; where the paper
// gives no figure the derivation is written out, and nothing is tuned to a result.
//
// Bursty serving (paper §9.2): 3,107 ChatBot Arena requests replayed over 375 s, two floods
// (80 and 120 requests/s) around ~300 s of quiet at ~5 requests/s; the figure puts the first
// flood at the start and the second at the end.
//   - Flood length (not in the paper): the requests the quiet rate leaves to the floods, at
//     the floods' rates, equal time each: 5 (375 - 2t) + 80 t + 120 t = 3107 gives t = 6.48 s.
//   - Layout: lead-in quiet, flood 1, `quiet_between_s` (300 s, paper), flood 2, tail quiet;
//     the lead-in and tail split what is left of 375 s equally (31 s each).
//   - Lengths: LMSYS-Chat-1M (Zheng et al., ICLR 2024, Table 1: 69.5 tokens a prompt, 214.5 a
//     response on average), log-normal with sigma 1.0 of the log: the spread Magpie's table
//     gives for LMSYS-Chat-1M turns (260 +- 347 tokens: a coefficient of variation of 1.33,
//     sigma = sqrt(ln(1 + 1.33^2)) = 1.01). Not modelled: a multi-turn conversation's history
//     in the prompt (2.0 turns on average), prefix reuse.
//   - Arrivals: Poisson within each period.
//
// RL rollout (paper §9.3): DeepMath, `steps` (9) rollout steps of `prompts_per_step` (2,048)
// prompts each, at most `output_cap` (32,768) output tokens; step k starts when every request
// of step k - 1 has finished (request::rollout_step).
//   - Output lengths: log-normal, its median `output_median` and its sigma set so that a share
//     `cut_share` of responses reaches the cap (cut there): sigma = ln(cap / median) /
//     z(1 - cut_share). Defaults: a 2% cut (the fewest the sources report) and the median,
//     2,000, that then gives the mean of DeepMath-103K's R1 solutions, about 4.5k tokens
//     (4-4.6k, DESIGN.md §8; the capped mean of this log-normal is 4.47k). The sweep covers
//     medians 4k-10k and cut shares 2-20%: recipes cap at 10k-40k and cut a few
//     to tens of percent.
//   - Prompt lengths: uniform in [prompt_min, prompt_max] (64-512; no source: a math problem
//     is a few hundred tokens, under 3% of a mean response, so its shape hardly matters).
//   - max_new_tokens: the cap, on every request (a rollout's client asks for the recipe's
//     response cap; an engine that reserves KV ahead charges admission by it).
//
// Steady serving (not in the paper; DESIGN.md §7's adversarial case: near the crossover no
// switch can pay, so a policy must not lose there): Poisson arrivals at `rate` for
// `duration_s` (the bursty experiment's 375 s), the bursty experiment's LMSYS-Chat-1M lengths.
// The demo sets the rate that keeps about B* sequences running (Little's law: B* over the
// mean output times the curves' step time at B*); nothing else is derived.
//
// Production-shaped serving (not in the paper): the host demo's production trace
// (trace.hpp `production_trace`, shaped like the Azure LLM inference trace 2023's conversation
// trace) at the paper's scale: its medians unscaled (each prompt token is a token of the run),
// the bursty experiment's 375 s and the other paper traces' clamps. Arrivals are Poisson at a
// rate redrawn every `rate_period_s` from a log-normal around `mean_rate`; the demo sets
// `mean_rate` as paper-steady's rate, with this trace's mean output
// (paper_production_output_mean). Each default below names its source.

#include <cstdint>
#include <vector>

#include "trace.hpp"

namespace mini_engine {

struct paper_bursty_options {
  int64_t target_requests = 3107;     // paper §9.2 (the flood length is derived from it)
  double duration_s = 375;            // paper §9.2
  double quiet_rate = 5;              // requests/s, paper §9.2
  double flood_rates[2] = {80, 120};  // requests/s, paper §9.2
  double quiet_between_s = 300;       // paper §9.2
  double prompt_mean = 69.5, output_mean = 214.5;  // LMSYS-Chat-1M, Table 1
  double length_sigma = 1.0;                       // Magpie's table (see above)
  int64_t prompt_max = 8192, output_max = 4096;    // clamps (0.01% and 0.2% of draws)
  int32_t vocab = 1024;
};

struct paper_rollout_options {
  int64_t steps = 9;                // paper §9.3
  int64_t prompts_per_step = 2048;  // paper §9.3
  int64_t output_cap = 32768;       // paper §9.3
  double output_median = 2000;      // see above: capped mean 4.47k (DeepMath-103K R1)
  double cut_share = 0.02;          // share of responses cut at the cap
  int64_t prompt_min = 64, prompt_max = 512;
  int32_t vocab = 1024;
};

struct paper_steady_options {
  double duration_s = 375;  // the bursty experiment's length
  double rate = 15;         // requests/s; the demo derives it from the crossover (above)
  double prompt_mean = 69.5, output_mean = 214.5;  // LMSYS-Chat-1M, as the bursty trace
  double length_sigma = 1.0;
  int64_t prompt_max = 8192, output_max = 4096;
  int32_t vocab = 1024;
};

struct paper_production_options {
  double duration_s = 375;  // the bursty experiment's length
  double mean_rate = 15;    // requests/s; the demo derives it from the crossover (above)
  // The rate's swing: production_options' (trace.hpp; no published figure of the Azure
  // trace's rate variation is modelled, so the host trace's log-normal is kept as it is).
  double rate_sigma = production_options{}.rate_sigma;
  double rate_period_s = production_options{}.rate_period_s;
  // Splitwise (ISCA 2024) §III, the Azure conversation trace: median prompt ~1020 tokens,
  // median output ~129, both long-tailed (log-normal, production_options' sigma).
  double prompt_median = production_options{}.prompt_median;
  double prompt_sigma = production_options{}.prompt_sigma;
  double output_median = production_options{}.output_median;
  double output_sigma = production_options{}.output_sigma;
  // Clamps as the other paper traces' (at the defaults 1.9% of prompts and 0.03% of outputs).
  int64_t prompt_max = 8192, output_max = 4096;
  int32_t vocab = 1024;
};

// The flood length the options imply (6.48 s at the defaults), and the periods in order:
// {start_s, end_s, rate}. Throws errc::invalid_argument when no flood length fits.
struct trace_period {
  double start_s = 0, end_s = 0, rate = 0;
  bool flood = false;
};
double paper_flood_length_s(const paper_bursty_options& o);
std::vector<trace_period> paper_bursty_periods(const paper_bursty_options& o);

// The log-normal sigma that puts `cut_share` of draws at or over `cap` with median `median`.
double paper_rollout_sigma(const paper_rollout_options& o);

// Throw errc::invalid_argument naming the field unless the options make sense (rates >= 0,
// durations > 0, means > 0, median < cap, 0 < cut_share < 0.5, 1 <= min <= max, vocab >= 1).
void validate(const paper_bursty_options& o);
void validate(const paper_rollout_options& o);
void validate(const paper_steady_options& o);
// Also: rate_sigma >= 0, rate_period_s > 0, medians >= 1, sigmas >= 0.
void validate(const paper_production_options& o);

// The mean output tokens of a request of the production-shaped trace: the log-normal's mean
// with the draws over output_max cut there (closed form). The demo's Little's-law rate reads it.
double paper_production_output_mean(const paper_production_options& o);

// Requests sorted by arrival, ids 0, 1, ... in that order; the same seed, the same trace.
std::vector<request> paper_bursty_trace(uint64_t seed, const paper_bursty_options& o = {});
// Every request arrives at 0 within its step (rollout_step 0 .. steps - 1, in step order).
std::vector<request> paper_rollout_trace(uint64_t seed, const paper_rollout_options& o = {});
// Requests sorted by arrival, ids 0, 1, ... in that order; the same seed, the same trace.
std::vector<request> paper_steady_trace(uint64_t seed, const paper_steady_options& o = {});
// production_trace at these options (prompt_scale 1): sorted by arrival, ids 0, 1, ... in that
// order; the same seed, the same trace.
std::vector<request> paper_production_trace(uint64_t seed,
                                            const paper_production_options& o = {});

}  // namespace mini_engine
