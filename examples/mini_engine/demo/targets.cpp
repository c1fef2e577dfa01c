#include "targets.hpp"

#include <cstdio>

namespace mini_engine::demo {

target_check check_targets(trace_kind kind, const run_summary& best, const run_summary& sw,
                           const char* sw_name, const targets& t) {
  char buf[512];
  const double ratio = best.tokens_per_s > 0 ? sw.tokens_per_s / best.tokens_per_s : 0;
  target_check c;
  switch (kind) {
    case trace_kind::rollout:
      c.met = ratio >= t.rollout_speedup;
      std::snprintf(buf, sizeof buf,
                    "target (rollout): %s >= %.2fx the best static tokens/s: %.3fx (%s)", sw_name,
                    t.rollout_speedup, ratio, c.met ? "met" : "MISSED");
      break;
    case trace_kind::bursty:
      c.met = ratio >= t.bursty_speedup && sw.p99_ttft_ms <= best.p99_ttft_ms;
      std::snprintf(buf, sizeof buf,
                    "target (bursty): %s's p99 TTFT and tokens/s at least the best static's: "
                    "%.3fx tokens/s, p99 TTFT %.1f vs %.1f ms (%s)",
                    sw_name, ratio, sw.p99_ttft_ms, best.p99_ttft_ms, c.met ? "met" : "MISSED");
      break;
    default:
      c.met = ratio >= t.others_speedup && sw.p99_ttft_ms <= best.p99_ttft_ms * t.others_p99_ttft;
      std::snprintf(buf, sizeof buf,
                    "target (%s): %s never more than 2%% worse than the best static: %.3fx "
                    "tokens/s, p99 TTFT %.1f vs %.1f ms (%s)",
                    kind == trace_kind::steady ? "steady" : "others", sw_name, ratio,
                    sw.p99_ttft_ms, best.p99_ttft_ms, c.met ? "met" : "MISSED");
      break;
  }
  c.line = buf;
  return c;
}

}  // namespace mini_engine::demo
