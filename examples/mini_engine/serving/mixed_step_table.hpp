#pragma once

// Measured mixed steps: per configuration, the wall clock of a whole step that decodes a batch
// and prefills one chunk beside it, by (decode batch b, chunk tokens t). What a prefill chunk
// measured alone (prefill_table.hpp) cannot say: the chunk inside a step that also decodes b
// sequences costs more than the alone-chunk's increment over the decode curve
// (mini_engine_fidelity: priced by that increment, the small prefill steps of the measured run
// came out at 0.64 of their measured time on one H100).
//
// Keyed by the rank that holds the chunk: under TP attention every rank runs every item, so b
// is the step's decode sequences and t its chunk; under data-parallel attention (EP) b is that
// rank's own decode sequences (measured with every rank decoding b, the chunk on one rank) and t
// its chunk. b = 0 is a step that prefills alone. The decode sequences of every point attend
// decode_context() tokens; a step whose sequences attend more adds the decode curve's difference
// (curves_step_clock.hpp).
//
// Given per configuration as rows of one decode batch each (b ascending strictly), each row its
// chunks (t ascending strictly): a rectangular grid when every row has the same chunks, though a
// row may stop short (a step holds at most its token budget, so a large b has no large t).
// Between the points, bilinear in (log2(b + 1), log2(t)): within a row linear in log2(t), then
// linear in log2(b + 1) between the two rows that bracket b. Clamped at the edges: below a row's
// smallest chunk, that chunk; below the smallest or above the largest b, that row. Above a row's
// largest chunk: linear extrapolation per token from its last two points, never falling (a last
// segment that falls by noise would price larger chunks below the largest measured one); a row of
// one chunk is flat.
//
//   EP rows b = 0: (16 tokens, 6 ms), (64, 8 ms); b = 3: (16, 10 ms), (64, 14 ms).
//     (b 0, t 32) -> 7 ms;  (b 1, t 16): log2(2) / log2(4) = 1/2 of the way: 8 ms;
//     (b 1, t 32) -> (7 + 12) / 2 = 9.5 ms;  (b 9, t 8) -> 10 ms (clamped);
//     (b 0, t 112) -> 8 + 48 x (2 / 48) = 10 ms

#include <cstdint>
#include <string>
#include <vector>

#include "configuration.hpp"

namespace mini_engine {

// One decode batch's measured steps: chunk_tokens[i] -> step_ms[i].
struct mixed_step_row {
  int64_t decode_batch = 0;            // b: decode sequences beside the chunk (>= 0; above)
  std::vector<int64_t> chunk_tokens;   // t: ascending strictly, each >= 1
  std::vector<double> step_ms;         // the whole step's wall clock, each finite and > 0
};

// One configuration's rows, ascending strictly in decode_batch.
struct mixed_step_grid {
  configuration mode = moebius::parallel_mode::ep;
  std::vector<mixed_step_row> rows;
};

class mixed_step_table {
 public:
  mixed_step_table() = default;  // empty: no configuration has points (the clock's "none")
  // At least one grid; each grid of a named configuration (is_named), no configuration twice,
  // at least one row; each row at least one chunk, as many step_ms as chunks. decode_context:
  // the tokens each decode sequence attends in every point (>= 1). `source` says where the
  // points come from (in errors and source()). Throws errc::invalid_argument naming the
  // offending grid, row or point: empty, non-increasing (batches or chunks) or non-positive
  // (tokens, ms, context; a negative batch).
  mixed_step_table(std::vector<mixed_step_grid> grids, int64_t decode_context, std::string source);

  bool empty() const { return grids_.empty(); }
  bool has(const configuration& c) const { return find(c) != nullptr; }
  std::vector<configuration> configurations() const;  // in the order given
  const std::string& source() const { return source_; }
  int64_t decode_context() const { return decode_context_; }
  // `c`'s largest measured decode batch (beyond it step_ms clamps; same error as step_ms).
  int64_t largest_batch(const configuration& c) const;
  // ms of a step in `c` that decodes `decode_batch` sequences at decode_context() and prefills
  // a chunk of `chunk_tokens` beside them (above). Throws errc::invalid_argument naming `c` when
  // it has no grid, or for a negative batch or a chunk below 1 token.
  double step_ms(const configuration& c, double decode_batch, double chunk_tokens) const;
  const mixed_step_grid& grid(const configuration& c) const;  // same error

 private:
  const mixed_step_grid* find(const configuration& c) const;

  std::vector<mixed_step_grid> grids_;
  int64_t decode_context_ = 0;
  std::string source_;
};

}  // namespace mini_engine
