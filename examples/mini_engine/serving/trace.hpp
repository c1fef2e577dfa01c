#pragma once

// Request traces for the mini-engine: generators drawn from a seed (bursty interactive
// traffic, an RL rollout, a steady Poisson load, a production-shaped load) and two file
// formats for users' own traces, JSONL (preferred) and whitespace-separated text.
//
// JSONL format (`.jsonl`): one JSON object per line, these members in any order:
//
//   {"arrival_s": 0.0, "prompt_tokens": 128, "output_tokens": 64}
//   {"arrival_s": 0.25, "prompt_tokens": 32, "output_tokens": 200}
//
//   arrival_s      seconds from the start of the trace: a JSON number, finite, >= 0
//   prompt_tokens  a JSON integer (no fraction or exponent) in [1, 2^20], read as 64-bit
//   output_tokens  a JSON integer in [1, 2^20]: tokens to generate
//   rollout_step   optional, a JSON integer in [0, 2^20]: the request belongs to step k of a
//                  closed-loop RL rollout and arrives arrival_s after every request of the
//                  steps before k has finished (RL training: a step's rollouts are generated
//                  when the policy update of the previous step is done), so one file holds a
//                  whole multi-step rollout
//   max_new_tokens optional, a JSON integer in [output_tokens, 2^20]: the most tokens the
//                  client allowed (its request's max_new_tokens); absent: the serving run's
//                  default (scheduler_options::default_max_new_tokens), raised to output_tokens
//                  where that is longer (a response never outgrows its client's limit)
// Blank lines are skipped; anything else (another member, a member twice or missing, a string,
// null, object or array value, a negative or non-finite number, text after the object) is an
// error naming the source, the line and the member. Lines are read by nlohmann/json (its SAX
// interface, so a number keeps its text and a member given twice is seen).
//
// Text format: one request per line, `arrival_s prompt_tokens output_tokens`, blank lines and
// `#` comments (whole-line or trailing) ignored. The prompt's token ids are not in the file:
// they are drawn from the reader's seed, so a file plus a seed is a reproducible workload.
//
//   # arrival_s prompt output
//   0.00  128  64
//   0.25   32 200    # a long answer

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace mini_engine {

struct request {
  int64_t id = 0;                // unique within a trace; the KV seq_id of the request
  double arrival_s = 0;          // seconds from the start of the trace
  std::vector<int32_t> prompt;   // token ids, [prompt_tokens]
  int64_t output_tokens = 1;     // tokens to generate (>= 1; the first one ends the prefill)
  // A closed-loop RL rollout's step (-1: an open-loop request): the requests of step k arrive
  // arrival_s after every request of step k - 1 has finished.
  int64_t rollout_step = -1;
  // The client's limit on output tokens (its max_new_tokens, >= output_tokens), or 0 when it
  // gave none: max_new_tokens_of() applies a default. An engine that reserves KV ahead of the
  // tokens (engine_preset::sglang) charges admission by it.
  int64_t max_new_tokens = 0;
};

// The max_new_tokens a request with none is served with by default (the demo's
// --max-new-tokens): SGLang's clip of the estimate (CLIP_MAX_NEW_TOKENS, 4096), so that a
// client that sets no limit (an OpenAI-style request without max_tokens, served up to the
// context length) is estimated as SGLang estimates it.
inline constexpr int64_t k_default_max_new_tokens = 4096;

// `r`'s max_new_tokens, or when it has none max(default_max_new_tokens, r.output_tokens): a
// response of n tokens shows that its client allowed at least n.
constexpr int64_t max_new_tokens_of(const request& r, int64_t default_max_new_tokens) {
  if (r.max_new_tokens > 0) return r.max_new_tokens;
  return r.output_tokens > default_max_new_tokens ? r.output_tokens : default_max_new_tokens;
}

// Quiet periods with a few requests, then bursts with many (Poisson arrivals in each).
//   defaults: 4 s quiet at 1 req/s, 2 s burst at 24 req/s, repeated for 20 s.
struct bursty_options {
  double duration_s = 20;
  double quiet_s = 4, quiet_rate = 1;   // length of a quiet period, requests per second in it
  double burst_s = 2, burst_rate = 24;  // length of a burst, requests per second in it
  int64_t prompt_min = 16, prompt_max = 256;
  int64_t output_min = 8, output_max = 96;
  int32_t vocab = 1024;
};

// A rollout: `batch` requests at t = 0 whose output lengths follow a heavy tail (log-normal),
// so the batch decays into a long tail of a few long generations.
struct rollout_options {
  int64_t batch = 128;
  int64_t prompt_min = 32, prompt_max = 128;
  double output_median = 48, output_sigma = 0.8;  // log-normal: median and sigma of the log
  int64_t output_max = 512;                       // clamp of the tail
  int32_t vocab = 1024;
};

// A steady load: Poisson arrivals at one rate, uniform lengths. Near the crossover, the load the
// engine sees wanders around B* and a switch cannot pay: the policy must not lose there.
struct steady_options {
  double duration_s = 10;
  double rate = 20;  // requests per second
  int64_t prompt_min = 16, prompt_max = 256;
  int64_t output_min = 8, output_max = 96;
  int32_t vocab = 1024;
};

// Shaped like a public production trace: the Azure LLM inference trace 2023 (Patel et al.,
// "Splitwise: Efficient Generative LLM Inference Using Phase Splitting", ISCA 2024, §III,
// traces published at github.com/Azure/AzurePublicDataset). Its conversation trace has a
// median prompt of about 1020 tokens and a median output of about 129 tokens, both long-tailed;
// the coding trace about 1500 and 13. Arrivals there are bursty (the request rate swings by
// several times within minutes); here they are a Poisson process whose rate is redrawn every
// `rate_period_s` from a log-normal around `mean_rate` (sigma `rate_sigma`). Lengths are
// log-normal around the medians, clamped; prompts are divided by `prompt_scale` (the host
// demo prices each context token as 32: a 1020-token prompt is 32 tokens of the run).
// These are the published summary figures, not the trace itself (nothing is downloaded).
struct production_options {
  double duration_s = 20;
  double mean_rate = 20, rate_sigma = 0.6, rate_period_s = 2;
  double prompt_median = 1020, prompt_sigma = 1.0;  // conversation (Splitwise §III)
  double output_median = 129, output_sigma = 1.0;
  double prompt_scale = 32;
  int64_t prompt_max = 1024, output_max = 1024;  // clamps, after scaling
  int32_t vocab = 1024;
};

// Throw moebius::error(errc::invalid_argument) naming the field unless every duration and
// rate is finite and >= 0 (periods > 0), 1 <= min <= max for the lengths, vocab >= 1.
void validate(const bursty_options& o);
void validate(const rollout_options& o);
void validate(const steady_options& o);
void validate(const production_options& o);

// Requests sorted by arrival, ids 0, 1, 2, ... in that order. Same seed, same trace.
std::vector<request> bursty_trace(uint64_t seed, const bursty_options& o = {});
std::vector<request> rollout_trace(uint64_t seed, const rollout_options& o = {});
std::vector<request> steady_trace(uint64_t seed, const steady_options& o = {});
std::vector<request> production_trace(uint64_t seed, const production_options& o = {});

// Token ids of a prompt of `num_tokens` tokens, drawn from (seed, id) alone: the same request
// has the same prompt whichever trace or file it comes from.
std::vector<int32_t> draw_prompt(uint64_t seed, int64_t id, int64_t num_tokens, int32_t vocab);

// Writes `arrival_s prompt_tokens output_tokens` per request (arrival with 6 decimals),
// after a `#` header line.
void write_trace(std::ostream& os, const std::vector<request>& requests);

// Reads the format above. Every line must hold exactly three numbers: arrival_s finite and
// >= 0, prompt_tokens in [1, 1<<20], output_tokens in [1, 1<<20], with nothing after them
// but a comment. Arrivals need not be sorted: requests come back sorted by arrival (stable),
// ids in file order. Throws errc::invalid_argument naming `source`, the line number and the
// field on the first bad line.
//   "0.5 12 3"  -> {id 0, arrival 0.5, 12 prompt ids, 3 outputs}
//   "0.5 12x 3" -> "trace.txt:1: prompt_tokens: '12x' is not an integer"
std::vector<request> read_trace(std::istream& is, uint64_t seed, int32_t vocab,
                                const std::string& source = "trace");

// JSONL (format above): one object per request in order, arrival with 6 decimals; rollout_step
// and max_new_tokens when the request has them.
void write_trace_jsonl(std::ostream& os, const std::vector<request>& requests);
// Reads JSONL; requests sorted by arrival (stable), ids in file order. Errors as read_trace:
//   {"arrival_s": 0.5, "prompt_tokens": 12, "output_tokens": 3}  -> {id 0, 0.5 s, 12, 3}
//   {"arrival_s": 0.5, "prompt_tokens": 1.5, "output_tokens": 3}
//     -> "t.jsonl:1: prompt_tokens: 1.5 is not an integer"
std::vector<request> read_trace_jsonl(std::istream& is, uint64_t seed, int32_t vocab,
                                      const std::string& source = "trace");
// A path ending in ".jsonl" is read as JSONL, any other as the text format.
std::vector<request> read_trace_file(const std::string& path, uint64_t seed, int32_t vocab);

}  // namespace mini_engine
