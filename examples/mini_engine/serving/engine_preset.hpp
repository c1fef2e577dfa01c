#pragma once

// The serving engine whose scheduling rules the scheduler follows (scheduler_options::engine,
// with admission_policy::known): admission, what a running request is charged, who loses its KV
// when the pool runs out, and what one step holds. Each rule names where that engine has it.
//
// vllm (the default; what the scheduler's known admission has always done, so no earlier run
// changes):
//   - pages on demand: a step allocates the pages of the tokens it writes and no more
//     (vllm/v1/core/kv_cache_manager.py, allocate_slots);
//   - admission of a waiting request while its whole prompt fits beside the running sequences'
//     tokens and a watermark of 1% of the pages (scheduler_options::watermark; vLLM's block
//     manager, vllm/core/block_manager.py can_allocate, watermark 0.01). vLLM V1 checks only
//     the first chunk's blocks and keeps no watermark; this preset keeps the stricter check;
//   - a sequence whose next tokens find no page preempts the newest running sequence by
//     recompute (itself when it is the newest) and the preempted one goes to the head of the
//     waiting queue (vllm/v1/core/sched/scheduler.py, schedule(): self.running.pop(),
//     waiting.prepend_request); no request is admitted in a step that preempted;
//   - one step mixes every decode, then the running prefill chunks, then new admissions'
//     chunks, within a token budget (max_num_batched_tokens; vLLM's default on >= 70 GiB GPUs
//     for the OpenAI server is 8,192 and max_num_seqs 1,024, vllm/engine/arg_utils.py
//     get_batch_defaults: the demo keeps the paper's 2,048 running sequences for both presets
//     so that they differ in their rules alone);
//   - under EP (data-parallel attention) one budget for the whole step by default; with
//     scheduler_options::vllm_dp_engines one per rank and max_running / P each, as vLLM's
//     data-parallel deployment runs one engine core, with its own scheduler, per DP rank
//     (docs/serving/data_parallel_deployment.md).
//
// sglang (python/sglang/srt/managers/schedule_policy.py PrefillAdder, schedule_batch.py
// ScheduleBatch.retract_decode, scheduler.py Scheduler.update_running_batch and
// get_new_batch_prefill, environ.py, server_args.py):
//   - admission: a waiting request is admitted only if its tokens plus
//     min(max_new_tokens, 4096) (CLIP_MAX_NEW_TOKENS, SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION)
//     is less than what is left: the free KV less every running request's charge
//     (PrefillAdder.add_one_req: total_tokens >= rem_total_tokens refuses). A request admitted
//     is charged that in full; a running request min(max_new_tokens - generated, 4096) x
//     new_token_ratio (PrefillAdder.__init__, rem_total_token_offset). A refusal latches the
//     batch full: no prefill is tried again until a running request finishes or is retracted
//     (running_batch.batch_is_full);
//   - new_token_ratio starts at 0.7 (SGLANG_INIT_NEW_TOKEN_RATIO) x schedule_conservativeness
//     (1.0), its floor is that x 0.14 (SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR), and every decode
//     step without a retraction lowers it by (init - floor) / 600
//     (SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS); it returns to init when the server is idle
//     (Scheduler.self_check_during_idle);
//   - retraction: when the next decode finds too few free pages for its tokens
//     (ScheduleBatch.check_decode_mem), the decoding requests are sorted by output length
//     descending, then prompt length ascending, and taken from the end (the fewest generated
//     tokens, then the longest prompt, then the newest: the sort is stable) until 20 tokens per
//     request left (SGLANG_RETRACT_DECODE_STEPS x running) are free, at least one and never
//     the last; they go to the back of the waiting queue (waiting_queue.extend) and are
//     recomputed from their tokens later. The ratio then becomes min(1, (tokens the remaining
//     requests decoded + 20 x their number) / their max_new_tokens) (retract_decode's
//     new_estimate_ratio);
//   - a step is a prefill or a decode, never both (mixed chunks off by default: enable_mixed_chunk):
//     a prefill batch runs whenever one can be formed (get_next_batch_to_run), chunked at
//     8,192 tokens (chunked_prefill_size on large GPUs);
//   - with sglang_rules::enable_mixed_chunk (the server's --enable-mixed-chunk) a prefill batch
//     carries the running decodes too (get_new_batch_prefill: new_batch.mix_with_running), and
//     the prefill's chunk and its room are each less one token per running request
//     (PrefillAdder's mixed_with_decode_tokens = running_bs: rem_chunk_tokens, rem_input_tokens
//     and the total offset). A mixed step does not decay the ratio (only update_running_batch,
//     a decode-only step, does). Where SGLang allocates a mixed step's decode slots without a
//     retraction check (prepare_for_decode), this preset retracts as a decode step would
//     rather than fail;
//   - max_new_tokens is clamped to what the pool can hold: the pool's tokens - 2 - the prompt
//     (Scheduler.handle_generate_request: max_req_len - len(input) - 1, max_req_len = pool - 1);
//   - CUDA graphs up to 512 sequences a decode batch (cuda_graph_max_bs on H200 at TP 8): a
//     larger decode batch runs eagerly (step_record::eager; the clock does not yet price it);
//   - with DP attention (the EP mode over P > 1 ranks: each rank attends to its own requests) every rank
//     schedules its own requests: schedule_conservativeness x 0.3, the prefill chunk divided by
//     the DP size (1,024 tokens a rank at 8 ranks) and max_running_requests too
//     (server_args.py _handle_data_parallelism; scheduler.py max_running_requests // dp_size);
//     each rank chooses prefill or decode for itself, so one step may hold one rank's prefill
//     beside another's decodes. A waiting request goes to the rank with the most room when it
//     is admitted (SGLang's controller dispatches at arrival, round robin: this is kinder to it).

#include <cstdint>

namespace mini_engine {

enum class engine_preset : uint8_t {
  vllm,    // the header's vLLM rules (scheduler_options::watermark applies)
  sglang,  // the header's SGLang rules (scheduler_options::sglang)
};

constexpr const char* to_string(engine_preset e) {
  return e == engine_preset::sglang ? "sglang" : "vllm";
}

// SGLang's scheduling constants (the header says where each is).
struct sglang_rules {
  double init_new_token_ratio = 0.7;
  double min_new_token_ratio_factor = 0.14;
  int64_t new_token_ratio_decay_steps = 600;
  double schedule_conservativeness = 1.0;
  double dp_attention_conservativeness = 0.3;  // x schedule_conservativeness under DP attention
  int64_t retract_decode_steps = 20;           // tokens per remaining request a retraction frees
  int64_t clip_max_new_tokens = 4096;          // the estimate's clip
  int64_t cuda_graph_max_bs = 512;             // decode batches above it run eagerly
  bool enable_mixed_chunk = false;             // --enable-mixed-chunk (above); off by default
};

// Throws errc::invalid_argument naming the field unless 0 < init_new_token_ratio,
// 0 < min_new_token_ratio_factor <= 1, schedule_conservativeness and
// dp_attention_conservativeness > 0, new_token_ratio_decay_steps, retract_decode_steps and
// clip_max_new_tokens >= 1, cuda_graph_max_bs >= 0.
void validate(const sglang_rules& r);

// The new-token ratio's course (SGLang's Scheduler.__init__): where it starts, its floor, and
// what each decode step without a retraction takes off it; with DP attention the
// conservativeness is x 0.3.
//   defaults: 0.7, 0.098, 0.001003 a step; DP attention: 0.21, 0.0294, 0.000301.
struct new_token_ratio_course {
  double init = 0, floor = 0, decay = 0;
};
new_token_ratio_course ratio_course(const sglang_rules& r, bool dp_attention);

}  // namespace mini_engine
