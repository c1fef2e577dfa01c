#pragma once

// How the serving loop runs one step (engine::serve_step), one type per case:
//
//   plain_steps         outside a switch: the batch takes pages from the switcher's growing
//                       tables, the step runs alone and is priced by step_clock::step_s;
//   progressive_driver  during a progressive switch (progressive_driver.hpp): the batch reads
//                       the frozen tables, the next paced layers' copies run beside the step and
//                       it is priced by step_clock::switch_step_s.
//
// The loop asks the runner for the step's pages, builds the batch from them, runs it through the
// runner and records what the runner says; it never asks which case it is in.

#include <cstdint>
#include <optional>
#include <vector>

#include <moebius/kv/kv_geometry.hpp>
#include <moebius/switch/switcher.hpp>

#include "page_source.hpp"
#include "run_report.hpp"
#include "scheduler.hpp"
#include "step.hpp"
#include "step_clock.hpp"

namespace mini_engine {

// What a step gave: its tokens, its time, and the tables it read.
struct served_step {
  std::vector<int32_t> tokens;
  double measured_s = 0;                   // host time, or the runtime's own (CUDA events)
  double clock_s = 0;                      // on the serving clock
  const moebius::kv_state* tables = nullptr;  // the tables the batch was built from
  // The layout it ran in (during a switch: the source's, whose tables the batch was built
  // from) and the configuration the clock priced it as (during a switch: its majority layout's).
  moebius::parallel_layout layout;
  configuration config;
};

class step_runner {
 public:
  virtual ~step_runner() = default;
  // The pages this step's batch takes (valid until the next open_step()).
  virtual page_source& open_step() = 0;
  // Whether the step runs with an empty batch (a switch's copies move with nothing to compute).
  virtual bool runs_without_batch() const = 0;
  // Runs `b` (possibly empty, when runs_without_batch()) and prices it; sets rec.layers and
  // rec.copy_ms when copies ran beside it.
  virtual served_step run(runtime& rt, const step_batch& b, step_record& rec) = 0;
};

// The cost the clock prices a step of `b` at: in `config`, its items' ranks split as
// `ep_split` says (EP attention; dropped under TP attention, where every rank runs every item).
step_cost cost_of(const step_batch& b, const configuration& config, int num_ranks,
                  std::vector<rank_work> ep_split);

// Steps outside a switch.
class plain_steps final : public step_runner {
 public:
  // `record_ranks`: engine_options::record_rank_split.
  plain_steps(const moebius::kv_geometry& kv, moebius::switcher& sw, const step_clock& clock,
              bool record_ranks)
      : kv_(kv), sw_(sw), clock_(clock), record_ranks_(record_ranks) {}

  page_source& open_step() override;
  bool runs_without_batch() const override { return false; }
  served_step run(runtime& rt, const step_batch& b, step_record& rec) override;

  // The last step on the serving clock (0: none yet): what a progressive switch paces from.
  double last_step_s() const { return last_step_s_; }

 private:
  const moebius::kv_geometry& kv_;
  moebius::switcher& sw_;
  const step_clock& clock_;
  bool record_ranks_;
  std::optional<growing_pages> pages_;
  double last_step_s_ = 0;
};

}  // namespace mini_engine
