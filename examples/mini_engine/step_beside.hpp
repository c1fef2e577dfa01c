#pragma once

// One step with a progressive switch's next advance beside it, ordered by the caller (the
// serving loop, the GPU runtime's tests and benchmarks): the runtime never calls back.
//
//   1. the step is enqueued, asking for its layer events (step_options::layer_events);
//   2. the advance is enqueued on them, so that its copies run while the step computes and
//      overwrite nothing the step still reads (moebius::copy_waits); a step with no events
//      (the host runtime, a static layout on the GPU) is finished first and the advance
//      follows it;
//   3. the step is finished; when its routing overflowed the graphs' expert capacity
//      (step_result::overflowed), the advance may already have overwritten what it read:
//      `settle` waits for the advance and says where the layers are now, and the step runs
//      again there, eagerly (step_options::rerun). The rerun writes every layer's K/V of the
//      step's positions again.
//
// An exception from the advance leaves after the step has finished (nothing of it may still
// run when the caller handles it).

#include <chrono>
#include <functional>
#include <span>
#include <vector>

#include "step.hpp"

namespace mini_engine {

struct step_beside_result {
  step_result step;      // the step's (the rerun's, when there was one)
  bool rerun = false;    // the step ran again where the advance settled
  double advance_s = 0;  // host seconds enqueueing the advance took
};

// `advance(events)` enqueues the advance (events: the step's, or null after the step);
// `settle()` waits for it and returns the layout to rerun at.
inline step_beside_result step_beside(
    runtime& rt, const step_layout& layout, std::span<const step_item> items,
    const std::function<void(const moebius::step_layer_events* events)>& advance,
    const std::function<step_layout()>& settle, std::vector<std::vector<float>>* logits = nullptr) {
  using host_clock = std::chrono::steady_clock;
  step_beside_result out;
  const auto timed_advance = [&](const moebius::step_layer_events* events) {
    const auto t0 = host_clock::now();
    advance(events);
    out.advance_s = std::chrono::duration<double>(host_clock::now() - t0).count();
  };
  step_options o;
  o.layer_events = true;
  o.logits = logits;
  const pending_step p = rt.enqueue(layout, items, o);
  if (p.layer_events != nullptr) {
    try {
      timed_advance(p.layer_events);
    } catch (...) {
      try {
        rt.finish(p);
      } catch (...) {  // the advance's error is the one to report
      }
      throw;
    }
    out.step = rt.finish(p);
  } else {
    out.step = rt.finish(p);
    timed_advance(nullptr);
  }
  if (out.step.overflowed) {
    const step_layout again = settle();
    step_options r;
    r.rerun = true;
    r.logits = logits;
    out.step = rt.finish(rt.enqueue(again, items, r));
    out.rerun = true;
  }
  return out;
}

}  // namespace mini_engine
