#pragma once

// Continuous batching for the mini-engine: a waiting queue in arrival order, admission bounded
// by the KV pool, chunked prefill under a token budget per step, decode, retirement.
//
// One step's batch is built in this order, within `max_step_tokens` (engine_preset::vllm and
// the oracle: scheduler_vllm.cpp; engine_preset::sglang: scheduler_sglang.cpp's order, a
// prefill or a decode):
//   1. decode: one token for every running sequence whose prompt is in the KV cache;
//   2. prefill: the next chunk of every sequence whose prompt is partly in the cache (oldest
//      admission first);
//   3. admission: waiting requests that have arrived, first come first served (no overtaking,
//      so a long prompt cannot starve), while a sequence slot, budget and KV pages remain;
//      each admitted request starts its first chunk in this step.
// Admission reserves (in its bookkeeping, not in the page tables) a running sequence's pages on
// its EP owner or on every TP rank, as scheduler_options::admission says:
//   oracle  at its largest, prompt + output - 1 tokens (the last sampled token is never
//           written): an output length no engine knows, so nothing is ever preempted;
//   known   what is known, by the rules of the engine scheduler_options::engine names
//           (engine_preset.hpp, each rule with its source):
//     vllm    the tokens it has (prompt and generated); a request is admitted while its prompt
//             fits beside those and a watermark of free pages; a sequence whose next tokens
//             find no page preempts the newest running sequence on its rank (itself when it is
//             the newest): vLLM's recompute preemption, see admission_policy;
//     sglang  a request is admitted while its tokens + min(max_new_tokens, 4096) fit beside
//             the running requests' remaining estimates x new_token_ratio; a decode that finds
//             too few pages retracts requests (fewest generated first) to the back of the queue
//             and raises the ratio; a step is a prefill (whenever one can be formed) or a
//             decode, per rank in EP (DP attention), with the batch order below per step kind.
// Page tables grow only as tokens are written, so the tables always describe exactly the KV
// the runtime wrote (what a switch moves). The EP owner is the rank with the most pages left
// after the running sequences' reservations.
//
// A switch can change the reservations (EP owners are chosen by the switcher's placement,
// TP holds every sequence on every rank): a sequence whose next token finds no page waits a
// step (a stall, counted) and keeps its place; it is never restarted. A batch that is empty
// while sequences run is a deadlock and throws errc::capacity.
//
// Reservations survive switches: the engine switches only when every running sequence's
// reservation fits the target mode (fits_reservations), and a TP->EP switch places the sequences
// by those sizes (ep_placement, handed to the switcher), so after any switch the reservations
// on every rank fit that rank (oracle: no sequence can find its next page missing; known: one
// that grows past them preempts, as without a switch).
//
// A closed-loop RL rollout (every request has a request::rollout_step): the steps run in order,
// and a step's requests arrive request::arrival_s after the last request of the steps before it
// has finished (its results' arrival_s say when that was); until then they are not waiting. A
// trace gives every request a step or none (errc::invalid_argument).
//
// Requests are validated before anything is admitted (validate_request): a bad one either fails
// alone (its result says why, naming it; it is never admitted and gets no token) or refuses the
// whole run, as scheduler_options::bad_requests says.
//
// Invariants (tested): every good request is admitted once (known: once more after each
// preemption or retraction) and finishes once with exactly output_tokens tokens; tokens are produced in order
// (a preempted sequence's recompute samples the token it would have decoded next: greedy tokens
// are those of the oracle admission); at the end every page is free.

#include <cstdint>
#include <deque>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <moebius/kv/kv_geometry.hpp>
#include <moebius/kv/page_table.hpp>
#include <moebius/kv/placement.hpp>

#include "engine_preset.hpp"
#include "page_source.hpp"
#include "step.hpp"
#include "trace.hpp"

namespace mini_engine {

// What the scheduler does with a request validate_request() refuses.
enum class bad_request_policy : uint8_t {
  fail_request,  // the request fails alone (request_result::error); the rest are served
  refuse_run,    // the constructor throws the request's error: nothing of the run is admitted
};

// How admission reserves KV pages (the header's comment says what each does).
enum class admission_policy : uint8_t {
  oracle,  // each request at its largest: never preempts (the mini-engine's tests, the default)
  // What is known; preemption by recompute, newest first (vLLM's scheduler: the victim is the
  // last of the running queue; its blocks are freed and it returns to the head of the waiting
  // queue; no request is admitted in a step that preempted).
  known,
};

struct scheduler_options {
  int64_t max_step_tokens = 256;  // token budget of one step: decode tokens + prefill chunks
  int64_t max_running = 64;       // sequences admitted at once (<= max_step_tokens)
  // Token ids must lie in [0, vocab); 0: not checked here (the engine sets it from
  // runtime::vocab_size(); the runtime checks ids again when its step runs).
  int64_t vocab = 0;
  bad_request_policy bad_requests = bad_request_policy::fail_request;
  admission_policy admission = admission_policy::oracle;
  // admission_policy::known: the share of a rank's pages a new admission leaves free while
  // sequences run, so that those do not preempt at once (vLLM's block manager: watermark 0.01).
  // engine_preset::vllm only.
  double watermark = 0.01;
  // admission_policy::known: whose rules (engine_preset.hpp). sglang: max_step_tokens is its
  // prefill chunk (chunked_prefill_size; EP: / ranks a rank), max_running its
  // max_running_requests (EP: / ranks a rank).
  engine_preset engine = engine_preset::vllm;
  sglang_rules sglang;  // engine_preset::sglang
  // engine_preset::vllm under EP (data-parallel attention) over P > 1 ranks: each rank
  // schedules its own requests within its own max_step_tokens and max_running / P, as vLLM's
  // data-parallel deployment runs one engine core, with its own scheduler and
  // max_num_batched_tokens, per DP rank (docs/serving/data_parallel_deployment.md: "each DP
  // rank is deployed as a separate core engine"); a new request goes to the rank with the most
  // unreserved pages among those with budget and room. false: one budget and one max_running
  // for the whole EP step (the preset's rule before this option).
  bool vllm_dp_engines = false;
  // The max_new_tokens of a request that gives none (max_new_tokens_of, trace.hpp).
  int64_t default_max_new_tokens = k_default_max_new_tokens;

  // The watermark admission leaves free beside running sequences: vLLM's; 0 otherwise.
  double admission_watermark() const {
    return admission == admission_policy::known && engine == engine_preset::vllm ? watermark : 0;
  }
  // The most prefill tokens one rank runs a step in the EP mode (data-parallel attention) over
  // `ranks` ranks: sglang's chunk divided by the DP size (at least 1); vLLM's whole budget
  // (one budget may put a whole chunk on one rank; a DP engine has a budget of its own).
  // Throws errc::invalid_argument for ranks < 1.
  int64_t rank_prefill_chunk(int64_t ranks) const;
};

// Throws errc::invalid_argument unless 1 <= max_running <= max_step_tokens, vocab >= 0,
// watermark is in [0, 1), default_max_new_tokens >= 1, and (engine sglang) the rules are valid
// (validate(sglang_rules)) and admission is known (the oracle's reservations are not SGLang's).
void validate(const scheduler_options& o);

// Throws moebius::error naming the request and the broken rule unless `r` can be served on the KV
// pool `g`: a prompt of >= 1 token, output_tokens >= 1, a finite arrival (errc::invalid_argument);
// prompt + output_tokens within 64 bits (errc::overflow); every token id in [0, vocab) when
// vocab > 0 (errc::invalid_argument); max_new_tokens 0 (none given) or >= output_tokens
// (errc::invalid_argument); and prompt + output_tokens - 1 tokens (its largest: the last
// sampled token is never written) within one rank's pages (errc::capacity: it could never be
// admitted).
//   vocab 256, prompt {5, 256}: "request 7: prompt token 1 is 256, outside the vocab [0, 256)"
void validate_request(const moebius::kv_geometry& g, const request& r, int64_t vocab);

// What happened to one request. Times are on the serving clock (seconds).
struct request_result {
  int64_t id = 0;
  double arrival_s = 0;
  double admitted_s = -1;     // when its first prefill chunk was scheduled
  double first_token_s = -1;  // end of the step that sampled its first token
  double finish_s = -1;       // end of the step that sampled its last token
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;
  int64_t admissions = 0;     // 1 once admitted; one more after each preemption
  int64_t preemptions = 0;    // times its KV was freed for another's (admission_policy::known)
  int64_t stalls = 0;         // steps it waited for a KV page after admission
  int64_t resumes = 0;        // times its KV was lost (a failed switch) and recomputed
  std::vector<int32_t> generated;  // greedy tokens, in order
  // Why it failed, "" when it did not: a bad request (validate_request's message), or a
  // sequence whose KV a failed switch lost when the engine fails such sequences.
  std::string error;

  bool finished() const { return finish_s >= 0; }
  bool failed() const { return !error.empty(); }
  double ttft_s() const { return first_token_s - arrival_s; }
  // Mean time per output token after the first (0 for a single-token answer).
  double tpot_s() const {
    return output_tokens > 1 ? (finish_s - first_token_s) / static_cast<double>(output_tokens - 1)
                             : 0.0;
  }
};

// The items of one step and what the clock needs to price it.
struct step_batch {
  std::vector<step_item> items;
  std::vector<int64_t> running_idx;  // [items] the scheduler's running slot of each item
  int64_t num_sequences = 0;         // items.size()
  int64_t decode_tokens = 0;         // items that decode one token
  int64_t prefill_tokens = 0;        // tokens of prefill chunks
  int64_t context_tokens = 0;        // sum over items of start_position + new tokens
  int64_t admitted = 0;              // requests admitted by this step
  int64_t stalled = 0;               // sequences skipped for want of a KV page
  // sglang without mixed chunks: decoding requests that sat this step out because their group
  // (TP: the one scheduler; EP: their rank's) ran a prefill instead. vllm: always 0 (its steps
  // carry every decode beside the prefill chunks).
  int64_t decodes_held = 0;
  // Admission stopped because the pool could not take the next waiting request (not the
  // batch cap or the step's token budget): requests wait with the pool full.
  bool admission_blocked = false;
  int64_t preempted = 0;             // running sequences preempted (sglang: retracted) (known)
  // A decode batch above the engine's CUDA-graph limit (sglang_rules::cuda_graph_max_bs; EP:
  // the largest rank's): the engine runs it eagerly. A hook for the clock, which does not yet
  // price it differently.
  bool eager = false;
  // sglang: new_token_ratio after this step (EP: the mean over the ranks); 0 otherwise.
  double new_token_ratio = 0;
  // After this step, over the running sequences (TP: one rank's view; EP: every rank's):
  // tokens whose K/V is written, and tokens admission counts as taken (the oracle: each at its
  // largest; vllm: the tokens each has; sglang: written + each one's charge).
  int64_t kv_written_tokens = 0;
  int64_t kv_reserved_tokens = 0;

  bool empty() const { return items.empty(); }
};

// What the serving loop's gate weighs (engine.hpp: the throughput gate): the live sequences
// and the queue, as an engine knows them (no request's output length).
struct work_view {
  int64_t running = 0;
  int64_t waiting = 0;               // arrived and not admitted (preempted ones included)
  int64_t running_tokens = 0;        // tokens the running sequences hold (prompt and generated)
  int64_t waiting_tokens = 0;        // tokens the waiting would hold at admission
  std::vector<int64_t> generated;    // per running sequence: tokens it has generated so far
  // Per running sequence: tokens it may still generate under its max_new_tokens (the client's
  // limit, which engines know; 0 when it is reached).
  std::vector<int64_t> left_to_limit;
  int64_t finished = 0;              // requests finished so far
  int64_t finished_output_tokens = 0;  // their output tokens
  bool rollout = false;              // a closed-loop rollout: no request arrives on its own
};

class scheduler {
 public:
  // Takes the requests (any order; ids unique) of one run over the KV pool `g`. Each request is
  // validated (validate_request): a bad one fails at once (bad_request_policy::fail_request,
  // its result's error says why) or the constructor throws its error (refuse_run). Throws
  // errc::invalid_argument for a repeated id (whatever the policy: results are keyed by id) or
  // bad options (engine sglang: max_step_tokens and max_running below g's ranks).
  scheduler(const moebius::kv_geometry& g, std::vector<request> requests,
            scheduler_options options = {});

  // The next step's batch from `pages` (page_source.hpp): decode, then prefill chunks, then
  // (when the pages admit) admission of what has arrived by `now_s`, each item within the
  // tokens `pages` grants it. Growing pages: empty only when nothing runs (then advance the
  // clock to next_arrival_s()); errc::capacity when sequences run and none can grow. Frozen
  // pages (a progressive switch): a sequence whose held tokens are used up waits (a stall);
  // the batch may be empty while sequences run.
  step_batch next_step(page_source& pages, double now_s);
  // Records a step that ended at `now_s`: the runtime's tokens for `b` (one per item, -1
  // where no sample), then retires finished requests and hands their pages back to `pages`.
  void finish_step(const step_batch& b, std::span<const int32_t> next_tokens, page_source& pages,
                   double now_s);

  // Before switcher::begin(): grows every running sequence's tables for the tokens it can
  // write in the next `steps` steps (decode: one a step; prefill: the rest of its prompt, then
  // one a step), clamped to its largest (prompt + output - 1), so that it can go on during the
  // switch on the frozen tables. Throws errc::capacity when the pages are not there (what was
  // reserved stays: it is within the admission's reservation, and the tables stay valid).
  void reserve_for_switch(moebius::kv_state& kv, int64_t steps);

  // Every request finished or failed.
  bool done() const {
    return num_finished_ + num_failed_ == static_cast<int64_t>(results_.size());
  }
  // Arrival of the first request not yet admitted (+inf when none waits).
  double next_arrival_s() const;
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  // Requests that have arrived by `now_s` and wait for admission (preempted ones included).
  int64_t num_waiting(double now_s) const;
  // The live sequences and the queue at `now_s` (O(running + waiting)).
  work_view work(double now_s) const;
  // Preemptions so far (admission_policy::known).
  int64_t num_preemptions() const { return num_preemptions_; }
  int64_t num_finished() const { return num_finished_; }
  int64_t finished_output_tokens() const { return finished_output_tokens_; }
  int64_t num_failed() const { return num_failed_; }
  // Running sequences whose prompt is not yet wholly in the KV cache (mid chunked prefill).
  int64_t num_prefilling() const;

  // Whether every running sequence's reservation (oracle: at its largest; known: the tokens it
  // has) fits the KV pool in mode `target` (TP: on every rank; EP: first-fit decreasing over
  // the ranks). A switch the policy proposes should pass this as well as the switcher's check
  // of the current tables. TP -> EP: the placement is ep_placement(kv).
  // `target_dcp`: the TP view's dcp after the switch (0: the pool's now; a dcp change keeps
  // the TP view and changes how many pages a rank holds of each sequence).
  bool fits_reservations(const moebius::kv_state& kv, moebius::parallel_mode target,
                         int64_t target_dcp = 0) const;
  // The owners a TP -> EP switch of the TP tables `kv` should give its sequences, indexed like
  // moebius::kv_demands_of(kv) (kv_migration_options::placement): longest-first by each running
  // sequence's reserved pages (a table the scheduler does not run counts as it stands), every
  // rank's whole EP pool as capacity. fits is false when they do not fit.
  moebius::kv_placement ep_placement(const moebius::kv_state& kv) const;
  // Tokens whose K/V the runtime has written, per running sequence: (seq_id, tokens), sorted by
  // id. The tables may hold more (reserved for a progressive switch, not yet written).
  std::vector<std::pair<int64_t, int64_t>> written_tokens() const;

  // --- After a switch that left the switcher inconsistent (engine recovery) ---------------
  // The sequences in `lost` (ids) no longer have K/V. fail: each fails with `why` (its result
  // says so; it gets no more tokens) and leaves the running set. resume: each keeps its place
  // and its tokens so far and is recomputed as a prefill of every token it has (prompt and
  // generated), which samples the token it would have decoded next: greedy tokens unchanged.
  // `kv` are the tables after the recovery (the lost sequences are not in them); each resumed
  // sequence gets a table of one token at once (so that a switch before its recompute moves
  // and counts it), in EP on the owner with the most pages left after the reservations, or
  // fails (capacity) when no rank has room for it at its largest. Returns how many running
  // sequences it resumed or failed (`lost` may name finished ones whose pages were not
  // released yet: nothing happens to them).
  int64_t lose_kv(moebius::kv_state& kv, std::span<const int64_t> lost, bool resume,
                  const std::string& why);
  // Per request, in the order of the ids given (sorted by id).
  const std::vector<request_result>& results() const { return results_; }
  const moebius::kv_geometry& geometry() const { return g_; }
  // After a committed change of the TP view's dcp (switcher::plan_dcp): the pool's geometry
  // at `dcp` (kv_geometry::dcp; with_dcp's checks). The tables the scheduler is handed are at
  // it from now on.
  void follow_dcp(int64_t dcp) { g_ = moebius::with_dcp(g_, dcp); }

 private:
  struct running_seq {
    int64_t result_idx = 0;
    std::vector<int32_t> tokens;  // prompt, then generated; capacity fixed at admission
    int64_t in_kv = 0;            // tokens whose K/V the runtime has written
    // Tokens to prefill before decoding: the prompt; after a resume (lose_kv) every token
    // it had, so that the prefill's sample is the next token.
    int64_t prompt = 0;
    int64_t final_tokens = 0;     // prompt + output - 1: the most it will hold
    int resume_owner = -1;        // EP: the owner a resumed sequence (lose_kv) was given
    int64_t step = -1;            // a closed-loop rollout's step (dense index), else -1
    // sglang: its max_new_tokens as the engine holds it (clamped to the pool: engine_preset.hpp)
    // and, while it waits after a retraction, when it joined the back of the queue.
    int64_t max_new = 0;
    double requeue_s = -std::numeric_limits<double>::infinity();
    int owner = -1;               // sglang, EP: its rank when last looked up (a hint)
    bool decoding() const { return in_kv >= prompt; }
  };

  // A closed-loop rollout: step `k` has finished at `now_s`; the next step's requests arrive
  // from then on.
  void start_next_step(int64_t k, double now_s);

  // Tokens the admission policy reserves for a running sequence (the header's comment).
  int64_t reserved_tokens(const running_seq& s) const;
  // Pages left per rank after the running sequences' reservations, in kv.mode.
  std::vector<int64_t> unreserved(const moebius::kv_state& kv) const;
  // admission_policy::known: the running sequence to preempt so that `slot` (not in this step's
  // batch yet) can grow on `rank` (-1: TP, every rank): the newest that holds pages there and is
  // not in the batch (`in_batch`) or preempted already; `slot` itself when none is newer; -1
  // when even `slot` holds nothing to free.
  int64_t preemption_victim(const moebius::kv_state& kv, int64_t slot, int rank,
                            const std::vector<bool>& in_batch,
                            const std::vector<bool>& preempted) const;
  // Frees running_[slot]'s pages through `pages` and queues it at the head of preempted_ to be
  // recomputed (every token it has, as a prefill) when it is admitted again.
  void preempt(int64_t slot, page_source& pages);
  // Frees running_[slot]'s pages and returns it ready to be recomputed (every token it has, as
  // a prefill); running_[slot] is left empty for the caller to drop.
  running_seq take_for_recompute(int64_t slot, page_source& pages);
  // Appends running_[b.running_idx-free] sequence `slot` to the step: `n` tokens from its
  // in_kv, which `pages` has granted.
  void push_item(step_batch& b, int64_t slot, int64_t n);
  // Drops the running sequences marked in `gone` (preempted or retracted) and remaps the
  // batch's running_idx to the slots left.
  void drop_running(step_batch& b, const std::vector<bool>& gone);
  // The waiting sequence to admit next at `now_s` (preempted or retracted ones by their queue
  // place, new requests by arrival), without taking it: .first true when it is preempted_'s
  // head, false for requests_[next_waiting_]; nullopt when none waits.
  std::optional<bool> next_waiting(double now_s) const;
  // A new running_seq of requests_[next_waiting_] (not yet taken off the queue).
  running_seq admit_new() const;
  // After a vllm or oracle step: kv_written_tokens and kv_reserved_tokens of `b`.
  void account(step_batch& b) const;

  // --- engine_preset::sglang (scheduler_sglang.cpp) -----------------------------------------
  // What one SGLang scheduler holds: a TP deployment runs one, DP attention (EP) one per rank.
  struct sglang_group {
    double ratio = 0;   // new_token_ratio
    bool full = false;  // running_batch.batch_is_full: no prefill tried until one finishes
    bool full_for_kv = false;  // full because the pool refused a request (not the batch cap)
  };
  step_batch next_step_sglang(page_source& pages, double now_s);
  // The ratio's course in `mode`: with DP attention (EP over more than one rank) or not.
  new_token_ratio_course sglang_course(moebius::parallel_mode mode) const;
  // Sets groups_ for `mode` (one group in TP, one per rank in EP) when it changes: each at the
  // mode's initial ratio, none full.
  void sglang_groups_for(moebius::parallel_mode mode);
  // The group of running_[i] in `kv` (TP: 0; EP: its owner).
  int sglang_group_of(const moebius::kv_state& kv, size_t i);
  // Tokens a group's free pages hold (TP: the rank with the fewest free pages).
  int64_t sglang_free_tokens(const moebius::kv_state& kv, int group) const;
  // min(max_new - generated, clip), >= 0: what SGLang estimates `s` may still write.
  int64_t sglang_remaining_new(const running_seq& s) const;
  // What admission charges running sequence `s` with `written` tokens in the tables beyond
  // them (sglang_rules, engine_preset.hpp): `prefilling`, the rest of its prompt and its
  // remaining estimate in full; decoding, the estimate x `ratio`.
  double sglang_charge(const running_seq& s, int64_t written, bool prefilling, double ratio) const;
  // The decode of group `group`: retracts (SGLang's retract_decode) when the group's free pages
  // do not hold its next tokens, updates the ratio (not in a `mixed` step: beside a prefill,
  // sglang_rules::enable_mixed_chunk), adds one token of every decoding sequence left. `gone`
  // marks the retracted.
  void sglang_decode(step_batch& b, page_source& pages, int group, const std::vector<int>& group_of,
                     std::vector<bool>& in_batch, std::vector<bool>& gone, double now_s,
                     bool mixed);
  std::vector<sglang_group> groups_;
  moebius::parallel_mode groups_mode_ = moebius::parallel_mode::ep;
  // Records a step's tokens, retires finished requests; returns their ids (pages to release).
  std::vector<int64_t> record_step(const step_batch& b, std::span<const int32_t> next_tokens,
                                   double now_s);

  moebius::kv_geometry g_;
  scheduler_options options_;
  std::vector<request> requests_;        // sorted by (arrival, id); a rollout: (step, arrival, id)
  size_t next_waiting_ = 0;              // requests_[next_waiting_..] wait
  // A closed-loop rollout, per dense step: [begin, end) of its requests in requests_, the
  // requests not yet finished, and their arrivals relative to the step's start (requests_
  // holds +inf until the step starts, then start + relative).
  struct rollout_step_state {
    size_t begin = 0, end = 0;
    int64_t left = 0;
  };
  std::vector<rollout_step_state> steps_;
  std::vector<double> relative_arrival_s_;  // per requests_ index (closed loop only)
  double last_step_s_ = 0;                  // the time of the last step recorded
  std::vector<request_result> results_;  // sorted by id
  std::vector<running_seq> running_;     // in admission order
  // Preempted sequences (known), admitted before any new request: the head first (vllm); and
  // retracted ones (sglang), each after the requests that arrived by its requeue_s.
  std::deque<running_seq> preempted_;
  int64_t num_preemptions_ = 0;
  int64_t num_finished_ = 0;
  int64_t finished_output_tokens_ = 0;
  int64_t num_failed_ = 0;
};

}  // namespace mini_engine
