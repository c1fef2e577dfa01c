#include "mixed_step_table.hpp"

#include <algorithm>
#include <cmath>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;

namespace {

// One row's step at `tokens`: linear in log2(tokens) between its chunks, clamped below, the
// last segment's slope per token (never falling) above.
double row_ms(const mixed_step_row& r, double tokens) {
  const std::vector<int64_t>& t = r.chunk_tokens;
  const std::vector<double>& ms = r.step_ms;
  if (t.size() == 1 || tokens <= static_cast<double>(t.front())) return ms.front();
  for (size_t i = 1; i < t.size(); ++i) {
    const double t0 = static_cast<double>(t[i - 1]), t1 = static_cast<double>(t[i]);
    if (tokens <= t1) {
      const double f = (std::log2(tokens) - std::log2(t0)) / (std::log2(t1) - std::log2(t0));
      return ms[i - 1] + f * (ms[i] - ms[i - 1]);
    }
  }
  const size_t n = t.size();
  const double slope =
      std::max(0.0, (ms[n - 1] - ms[n - 2]) / static_cast<double>(t[n - 1] - t[n - 2]));
  return ms[n - 1] + slope * (tokens - static_cast<double>(t[n - 1]));
}

}  // namespace

mixed_step_table::mixed_step_table(std::vector<mixed_step_grid> grids, int64_t decode_context,
                                   std::string source)
    : grids_(std::move(grids)), decode_context_(decode_context), source_(std::move(source)) {
  MOEBIUS_CHECK(!grids_.empty(), errc::invalid_argument, "mixed-step table (", source_,
                "): empty (no configuration has a grid)");
  MOEBIUS_CHECK(decode_context_ >= 1, errc::invalid_argument, "mixed-step table (", source_,
                "): decode_context ", decode_context_, " must be >= 1 token");
  for (size_t g = 0; g < grids_.size(); ++g) {
    const mixed_step_grid& grid = grids_[g];
    const std::string name = name_of(grid.mode);
    MOEBIUS_CHECK(is_named(grid.mode), errc::invalid_argument, "mixed-step table (", source_,
                  "): grid ", g, " has no named configuration (", name, ")");
    for (size_t h = 0; h < g; ++h)
      MOEBIUS_CHECK(!(grids_[h].mode == grid.mode), errc::invalid_argument, "mixed-step table (",
                    source_, "): ", name, " has two grids (", h, " and ", g, ")");
    MOEBIUS_CHECK(!grid.rows.empty(), errc::invalid_argument, "mixed-step table (", source_,
                  "): ", name, "'s grid is empty (no rows)");
    for (size_t i = 0; i < grid.rows.size(); ++i) {
      const mixed_step_row& r = grid.rows[i];
      MOEBIUS_CHECK(r.decode_batch >= 0, errc::invalid_argument, "mixed-step table (", source_,
                    "): ", name, " row ", i, " has a negative decode batch (", r.decode_batch,
                    ")");
      MOEBIUS_CHECK(i == 0 || r.decode_batch > grid.rows[i - 1].decode_batch,
                    errc::invalid_argument, "mixed-step table (", source_, "): ", name,
                    " rows must ascend strictly in decode batch (row ", i, ": ", r.decode_batch,
                    " after ", i == 0 ? 0 : grid.rows[i - 1].decode_batch, ")");
      MOEBIUS_CHECK(!r.chunk_tokens.empty(), errc::invalid_argument, "mixed-step table (",
                    source_, "): ", name, " decode batch ", r.decode_batch,
                    ": empty row (no chunks)");
      MOEBIUS_CHECK(r.chunk_tokens.size() == r.step_ms.size(), errc::invalid_argument,
                    "mixed-step table (", source_, "): ", name, " decode batch ",
                    r.decode_batch, ": ", r.chunk_tokens.size(), " chunks but ", r.step_ms.size(),
                    " step_ms");
      for (size_t j = 0; j < r.chunk_tokens.size(); ++j) {
        const int64_t t = r.chunk_tokens[j];
        const double ms = r.step_ms[j];
        MOEBIUS_CHECK(t >= 1 && ms > 0 && std::isfinite(ms), errc::invalid_argument,
                      "mixed-step table (", source_, "): ", name, " decode batch ",
                      r.decode_batch, " point ", j, " needs chunk tokens >= 1 and a positive "
                      "finite step_ms (got tokens ", t, ", step_ms ", ms, ")");
        MOEBIUS_CHECK(j == 0 || t > r.chunk_tokens[j - 1], errc::invalid_argument,
                      "mixed-step table (", source_, "): ", name, " decode batch ",
                      r.decode_batch, ": chunks must ascend strictly (point ", j, ": ", t,
                      " tokens after ", j == 0 ? 0 : r.chunk_tokens[j - 1], ")");
      }
    }
  }
}

std::vector<configuration> mixed_step_table::configurations() const {
  std::vector<configuration> out;
  for (const mixed_step_grid& g : grids_) out.push_back(g.mode);
  return out;
}

const mixed_step_grid* mixed_step_table::find(const configuration& c) const {
  for (const mixed_step_grid& g : grids_)
    if (g.mode == c) return &g;
  return nullptr;
}

const mixed_step_grid& mixed_step_table::grid(const configuration& c) const {
  const mixed_step_grid* g = find(c);
  MOEBIUS_CHECK(g != nullptr, errc::invalid_argument, "mixed-step table (", source_, "): no ",
                name_of(c), " grid");
  return *g;
}

int64_t mixed_step_table::largest_batch(const configuration& c) const {
  return grid(c).rows.back().decode_batch;
}

double mixed_step_table::step_ms(const configuration& c, double decode_batch,
                                 double chunk_tokens) const {
  const std::vector<mixed_step_row>& rows = grid(c).rows;
  MOEBIUS_CHECK(decode_batch >= 0 && chunk_tokens >= 1, errc::invalid_argument,
                "mixed-step table (", source_, "): ", name_of(c), " asked for decode batch ",
                decode_batch, " and chunk ", chunk_tokens,
                " tokens (a batch >= 0 and a chunk >= 1 token)");
  if (decode_batch <= static_cast<double>(rows.front().decode_batch))
    return row_ms(rows.front(), chunk_tokens);
  const auto x = [](double b) { return std::log2(b + 1); };
  for (size_t i = 1; i < rows.size(); ++i) {
    const double b0 = static_cast<double>(rows[i - 1].decode_batch);
    const double b1 = static_cast<double>(rows[i].decode_batch);
    if (decode_batch <= b1) {
      const double f = (x(decode_batch) - x(b0)) / (x(b1) - x(b0));
      const double a = row_ms(rows[i - 1], chunk_tokens), b = row_ms(rows[i], chunk_tokens);
      return a + f * (b - a);
    }
  }
  return row_ms(rows.back(), chunk_tokens);  // above the largest batch: clamped
}

}  // namespace mini_engine
