#pragma once

// The phase marks of transport::mark_phases() and the waits of wait_before_phases(), as every
// transport keeps them: set() checks and stores them for the next plan, take() hands the
// enqueue those its plan reaches.

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/transport/transport.hpp"

namespace moebius::detail {

class phase_marks {
 public:
  // Throws errc::invalid_argument for a negative mark or marks that are not ascending.
  static void check(std::span<const int64_t> after_phases, const char* transport_name) {
    for (size_t j = 0; j < after_phases.size(); ++j) {
      MOEBIUS_CHECK(after_phases[j] >= 0 && (j == 0 || after_phases[j] > after_phases[j - 1]),
                    errc::invalid_argument, transport_name, "::mark_phases: marks must be >= 0 ",
                    "and strictly ascending (mark ", j, " is ", after_phases[j], ")");
    }
  }
  // check(), then keeps the marks for the next plan (on a throw the earlier ones stay).
  void set(std::span<const int64_t> after_phases, const char* transport_name) {
    check(after_phases, transport_name);
    pending_.assign(after_phases.begin(), after_phases.end());
  }

  // The marks below `num_phases`, for the plan being enqueued; clears the list (marks are for
  // one plan only).
  std::vector<int64_t> take(int64_t num_phases) {
    std::vector<int64_t> reached = std::exchange(pending_, {});
    reached.resize(reached_count(reached, num_phases));
    return reached;
  }
  // How many of ascending `marks` a plan of `num_phases` phases reaches.
  static size_t reached_count(std::span<const int64_t> marks, int64_t num_phases) {
    return static_cast<size_t>(std::lower_bound(marks.begin(), marks.end(), num_phases) -
                               marks.begin());
  }

 private:
  std::vector<int64_t> pending_;
};

// Checks transport::wait_before_phases() arguments (see transport.hpp) and keeps them for the
// next plan; take() returns those the plan reaches.
class phase_waits {
 public:
  static void check(std::span<const transport::phase_wait> waits, size_t num_local,
                    const char* transport_name) {
    for (size_t j = 0; j < waits.size(); ++j) {
      MOEBIUS_CHECK(waits[j].phase >= 0 && (j == 0 || waits[j].phase > waits[j - 1].phase),
                    errc::invalid_argument, transport_name,
                    "::wait_before_phases: phases must be >= 0 and strictly ascending (wait ", j,
                    " is before phase ", waits[j].phase, ")");
      MOEBIUS_CHECK(waits[j].events.size() == num_local, errc::invalid_argument, transport_name,
                    "::wait_before_phases: wait ", j, " has ", waits[j].events.size(),
                    " events for ", num_local, " local ranks");
    }
  }
  // check(), then keeps the waits for the next plan.
  void set(std::span<const transport::phase_wait> waits, size_t num_local,
           const char* transport_name) {
    check(waits, num_local, transport_name);
    pending_.assign(waits.begin(), waits.end());
  }
  std::vector<transport::phase_wait> take(int64_t num_phases) {
    std::vector<transport::phase_wait> reached = std::exchange(pending_, {});
    while (!reached.empty() && reached.back().phase >= num_phases) reached.pop_back();
    return reached;
  }

 private:
  std::vector<transport::phase_wait> pending_;
};

// Throws errc::out_of_range unless `mark` < num_marks and `local_index` < num_local.
inline void check_phase_event(size_t mark, size_t num_marks, size_t local_index, size_t num_local,
                              const char* transport_name) {
  MOEBIUS_CHECK(mark < num_marks && local_index < num_local, errc::out_of_range, transport_name,
                "::phase_event(", mark, ", ", local_index, "): the last plan has ", num_marks,
                " marks and the transport ", num_local, " local ranks");
}

}  // namespace moebius::detail
