#include "moebius/switch/overlap.hpp"

#include <algorithm>

#include "moebius/error.hpp"

namespace moebius {
namespace {

// Whether `layers` is an advance from `before`, and in which direction (true: EP->TP).
bool check_advance(int64_t num_layers, arena_cursor before, std::span<const int64_t> layers,
                   const char* what) {
  MOEBIUS_CHECK(num_layers >= 1 && before.tp_layers >= 0 && before.tp_layers <= num_layers,
                errc::invalid_argument, what, ": cursor ", before.tp_layers, " outside [0, ",
                num_layers, "]");
  MOEBIUS_CHECK(!layers.empty(), errc::invalid_argument, what, ": an advance moves >= 1 layer");
  const bool to_tp = layers.front() == before.tp_layers;
  const int64_t step = to_tp ? 1 : -1;
  for (size_t i = 0; i < layers.size(); ++i) {
    const int64_t want = to_tp ? before.tp_layers + static_cast<int64_t>(i)
                               : before.tp_layers - 1 - static_cast<int64_t>(i);
    MOEBIUS_CHECK(layers[i] == want && want >= 0 && want < num_layers, errc::invalid_argument,
                  what, ": layer ", i, " of the advance is ", layers[i], "; from cursor ",
                  before.tp_layers, " an advance moves layers ", before.tp_layers, ", ",
                  before.tp_layers + step, ", ... (EP->TP) or ", before.tp_layers - 1, ", ",
                  before.tp_layers - 2, ", ... (TP->EP), within [0, ", num_layers, ")");
  }
  return to_tp;
}

}  // namespace

std::vector<int64_t> copy_waits(int64_t num_layers, arena_cursor before,
                                std::span<const int64_t> layers) {
  const bool to_tp = check_advance(num_layers, before, layers, "copy_waits");
  std::vector<int64_t> out;
  int64_t ordered = -1;  // the step layer every copy so far waited for (stream order)
  for (size_t i = 0; i < layers.size(); ++i) {
    const int64_t j = layers[i];
    // See the header: EP->TP needs S_j; TP->EP needs S_{j+1} while j+1 runs TP, else S_j.
    const int64_t need = to_tp ? j : std::max(j, std::min(j + 1, before.tp_layers - 1));
    if (need > ordered) {
      out.push_back(need);
      ordered = need;
    } else {
      out.push_back(-1);
    }
  }
  return out;
}

std::vector<int64_t> step_waits(int64_t num_layers, arena_cursor before,
                                std::span<const int64_t> layers) {
  check_advance(num_layers, before, layers, "step_waits");
  // The step reads ascending; a wait on E_j orders every event recorded before it (the copies
  // run in `layers` order). So walk the layers ascending and wait where the events waited so
  // far do not cover the layer.
  std::vector<int64_t> ascending(layers.begin(), layers.end());
  std::sort(ascending.begin(), ascending.end());
  std::vector<int64_t> out;
  size_t covered = 0;  // events [0, covered) of the move order are ordered before the step
  for (const int64_t l : ascending) {
    const auto at = static_cast<size_t>(std::find(layers.begin(), layers.end(), l) - layers.begin());
    if (at < covered) continue;
    out.push_back(l);
    covered = at + 1;
  }
  return out;
}

}  // namespace moebius
