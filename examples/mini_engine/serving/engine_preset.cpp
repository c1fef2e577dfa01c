#include "engine_preset.hpp"

#include <algorithm>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;

void validate(const sglang_rules& r) {
  MOEBIUS_CHECK(r.init_new_token_ratio > 0, errc::invalid_argument,
                "sglang rules: init_new_token_ratio must be > 0 (got ", r.init_new_token_ratio, ")");
  MOEBIUS_CHECK(r.min_new_token_ratio_factor > 0 && r.min_new_token_ratio_factor <= 1,
                errc::invalid_argument, "sglang rules: min_new_token_ratio_factor must be in (0, 1] "
                "(got ", r.min_new_token_ratio_factor, ")");
  MOEBIUS_CHECK(r.schedule_conservativeness > 0 && r.dp_attention_conservativeness > 0,
                errc::invalid_argument, "sglang rules: schedule_conservativeness (",
                r.schedule_conservativeness, ") and dp_attention_conservativeness (",
                r.dp_attention_conservativeness, ") must be > 0");
  MOEBIUS_CHECK(r.new_token_ratio_decay_steps >= 1 && r.retract_decode_steps >= 1 &&
                    r.clip_max_new_tokens >= 1,
                errc::invalid_argument, "sglang rules: new_token_ratio_decay_steps (",
                r.new_token_ratio_decay_steps, "), retract_decode_steps (", r.retract_decode_steps,
                ") and clip_max_new_tokens (", r.clip_max_new_tokens, ") must be >= 1");
  MOEBIUS_CHECK(r.cuda_graph_max_bs >= 0, errc::invalid_argument,
                "sglang rules: cuda_graph_max_bs must be >= 0 (got ", r.cuda_graph_max_bs, ")");
}

new_token_ratio_course ratio_course(const sglang_rules& r, bool dp_attention) {
  const double conservativeness =
      r.schedule_conservativeness * (dp_attention ? r.dp_attention_conservativeness : 1.0);
  new_token_ratio_course c;
  c.init = std::min(r.init_new_token_ratio * conservativeness, 1.0);
  c.floor = std::min(c.init * r.min_new_token_ratio_factor, 1.0);
  c.decay = (c.init - c.floor) / static_cast<double>(r.new_token_ratio_decay_steps);
  return c;
}

}  // namespace mini_engine
