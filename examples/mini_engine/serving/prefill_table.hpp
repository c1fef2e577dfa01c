#pragma once

// Measured prefill-chunk steps: per configuration, the wall clock of a step that prefills one
// chunk alone (one sequence, its first chunk: attention over the chunk's own tokens), by the
// chunk's tokens. What the step curves cannot say about a prefill: the GPU runtime runs every
// step that prefills eagerly (no CUDA graph: graphs are captured for decode steps), so a small
// chunk pays the kernel launches a graph replay avoids; the curves' extra rows price it as a
// graph replay of a larger decode batch (mini_engine_fidelity measured small prefill steps at
// 1.5-2.9x that price on one H200).
//
// Keyed by the chunk's tokens on the busiest rank: under TP attention every rank runs every
// token, so the step's tokens; under data-parallel attention (EP) the rank that holds the
// sequence runs them (measured with the others idle). curves_step_clock asks it for a rank's
// own tokens (step_curves.hpp).
//
// Between the points: linear in log2(tokens); below the smallest, the smallest; beyond the
// largest, the last segment's slope in the tokens themselves (never falling), as the step
// curves do in the batch.
//
//   EP points (16 tokens, 6 ms), (64, 8 ms): 32 tokens -> 7 ms; 8 -> 6 ms;
//   112 -> 8 + 48 x (2 / 48) = 10 ms

#include <cstdint>
#include <string>
#include <vector>

#include "configuration.hpp"

namespace mini_engine {

struct prefill_point {
  configuration mode = moebius::parallel_mode::ep;
  int64_t tokens = 0;  // the chunk's tokens (on the busiest rank; above)
  double step_ms = 0;  // the step's wall clock as the serving loop waits for it
};

class prefill_table {
 public:
  prefill_table() = default;  // empty: no configuration has points
  // Each point a named configuration (is_named), tokens >= 1 and a positive finite step_ms;
  // no (configuration, tokens) twice. `source` says where the points come from (in errors and
  // source()). Throws errc::invalid_argument naming the offending point.
  prefill_table(std::vector<prefill_point> points, std::string source);

  bool empty() const { return tables_.empty(); }
  bool has(const configuration& c) const { return find(c) != nullptr; }
  // The configurations with points, in the order first seen (sorted as the curves: TP, EP,
  // then by name).
  std::vector<configuration> configurations() const;
  const std::string& source() const { return source_; }
  // ms of a step that prefills a chunk of `tokens` alone in `c` (above). Throws
  // errc::invalid_argument naming `c` when it has no points.
  double step_ms(const configuration& c, double tokens) const;
  // `c`'s points, ascending in tokens (same error).
  const std::vector<prefill_point>& points(const configuration& c) const;

 private:
  struct table {
    configuration config;
    std::vector<prefill_point> points;  // ascending in tokens
  };
  const table* find(const configuration& c) const;

  std::vector<table> tables_;
  std::string source_;
};

}  // namespace mini_engine
