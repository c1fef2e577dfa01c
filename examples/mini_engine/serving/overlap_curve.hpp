#pragma once

// How much longer a decode step takes with bytes copied beside it on the same GPU: the
// measured slowdown curve that prices the steps of a progressive switch on a priced clock
// (DESIGN.md §7, "What overlap costs"). Measured, not modelled: the points are
// docs/results/step_beside_copies_h200x1_summary.jsonl, compiled in at build time
// (CMakeLists.txt), from
//   MOEBIUS_BENCH_SUMMARY=... .carry/bin/bench_mini_engine_step_beside_copies   (one H200)
// Qwen3-30B-A3B shapes at P=1, graph replay, context 1024, batches 1/16/64/256 (steps of 7.1 to
// 35.6 ms alone), 256 MiB, 1 GiB and 4 GiB of device-to-device copies on a second stream
// (a rank that sends V and receives V reads and writes V of its own HBM).
//
// Between the points: linear in the bytes within a batch's row (0 bytes: 1.0; beyond the
// largest, the last segment's slope), then linear in the step's time between the two rows
// whose steps bracket it (outside the rows: the nearest row). So a step priced at 12 ms with
// 1 GiB beside it reads between the batch-1 (7.1 ms: 1.139) and batch-16 (20.3 ms: 1.022) rows.

#include <cstdint>
#include <span>
#include <vector>

namespace mini_engine {

struct slowdown_point {
  double step_ms = 0;  // the step alone
  double copy_mib = 0;  // MiB copied beside it (per GPU)
  double slowdown = 1;  // step beside the copies / step alone
};

class overlap_slowdown_curve {
 public:
  // The points as measured (rows of one step time, ascending in copy_mib); throws
  // errc::invalid_argument unless each row's bytes ascend and every value is positive.
  explicit overlap_slowdown_curve(std::span<const slowdown_point> points);
  // The one H200 curve above.
  static const overlap_slowdown_curve& h200();

  // The factor (>= 1) a step of `step_s` seconds alone takes longer with `bytes` beside it.
  double at(double step_s, int64_t bytes) const;
  // Where the points come from, for clock lines.
  static const char* h200_source();

 private:
  // The rows (runs of one step time), ascending in step time.
  std::vector<std::span<const slowdown_point>> rows_;
};

}  // namespace mini_engine
