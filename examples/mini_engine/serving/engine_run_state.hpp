#pragma once

// What one engine::run carries from step to step (engine.cpp: the loop and the switch;
// engine_recovery.cpp; engine_calibration.cpp). The run's policy (run_policy.hpp) and the
// progressive switch in flight (progressive_driver.hpp) are objects of their own; this holds
// them, the scheduler and the clock.

#include <memory>
#include <optional>
#include <string>

#include "engine.hpp"
#include "progressive_driver.hpp"
#include "run_policy.hpp"
#include "scheduler.hpp"
#include "step_runner.hpp"

namespace mini_engine {

struct engine::run_state {
  run_state(const moebius::kv_geometry& kv, std::vector<request> requests, const engine_options& o,
            const scheduler_options& so, const std::string& run_name, moebius::switcher& sw,
            const step_clock& clock)
      : options(o), name(run_name), sched(kv, std::move(requests), so), plain(kv, sw, clock, o.record_rank_split) {}

  const engine_options& options;
  const std::string& name;
  scheduler sched;
  plain_steps plain;                         // steps outside a switch
  std::optional<run_policy> policy;          // switching::policy
  std::unique_ptr<progressive_driver> driver;  // the progressive switch in flight, if any
  bool admission_blocked = false;            // the last step's (step_batch::admission_blocked)
  run_result out;
  double now = 0;
  size_t next_forced = 0;
  size_t next_forced_at = 0;  // into engine_options::forced_at_s
  int64_t total = 0;

  // The runner of the next step.
  step_runner& runner() { return driver ? static_cast<step_runner&>(*driver) : plain; }
};

}  // namespace mini_engine
