#include "runs.hpp"

#include <chrono>
#include <cstdio>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace mini_engine::demo {

namespace {

using wall = std::chrono::steady_clock;

}  // namespace

const char* label_of(run_kind k) {
  switch (k) {
    case run_kind::static_tp:
      return "static TP";
    case run_kind::static_ep:
      return "static EP";
    case run_kind::switching:
      return "ours";
    case run_kind::progressive:
      return "ours progressive";
    case run_kind::no_gate:
      return "no gate";
    case run_kind::paper_policy:
      return "paper policy";
    case run_kind::by_cost:
      return "ours by cost";
    case run_kind::static_tp_dcp2:
      return "static TP-DCP2";
    case run_kind::static_tep_dcp2:
      return "static TEP-DCP2";
    case run_kind::switching_dcp2:
      return "ours DCP2";
    case run_kind::experts_only:
      return "ours experts";
    case run_kind::dcp_only:
      return "ours dcp";
  }
  return "unknown";
}

deployment_kind deployment_of(run_kind k) {
  switch (k) {
    case run_kind::static_tp:
      return deployment_kind::static_tp;
    case run_kind::static_ep:
      return deployment_kind::static_ep;
    case run_kind::static_tp_dcp2:
      return deployment_kind::static_tp_dcp2;
    case run_kind::static_tep_dcp2:
      return deployment_kind::static_tep_dcp2;
    case run_kind::switching_dcp2:
      return deployment_kind::switching_dcp2;
    case run_kind::experts_only:
      return deployment_kind::experts_only;
    case run_kind::dcp_only:
      return deployment_kind::dcp_only;
    default:
      return deployment_kind::switching;
  }
}

bool is_static(run_kind k) {
  return k == run_kind::static_tp || k == run_kind::static_ep ||
         k == run_kind::static_tp_dcp2 || k == run_kind::static_tep_dcp2;
}

bool is_other_design(run_kind k) {
  return k == run_kind::switching_dcp2 || k == run_kind::experts_only ||
         k == run_kind::dcp_only;
}

const run_outcome* find_run(const std::vector<run_outcome>& runs, run_kind k) {
  for (const run_outcome& r : runs) {
    if (r.kind == k) return &r;
  }
  return nullptr;
}

const run_outcome& run_of(const std::vector<run_outcome>& runs, run_kind k) {
  const run_outcome* r = find_run(runs, k);
  if (r == nullptr) throw std::logic_error(std::string("no run '") + label_of(k) + "' was served");
  return *r;
}

run_pool::run_pool(std::vector<world> worlds, const step_clock& clock)
    : clock_(clock), width_(worlds.size()) {
  for (world& w : worlds) fixed_.push_back(make_seat(std::move(w)));
}

run_pool::run_pool(size_t width, const step_clock& clock)
    : clock_(clock), width_(width), per_run_(true) {}

run_pool::~run_pool() = default;

run_pool::seat run_pool::make_seat(world w) const {
  seat s{std::move(w), nullptr, nullptr};
  s.transport = s.w.make_transport();
  s.eng = std::make_unique<engine>(*s.w.rt, *s.transport, s.w.arena, s.w.kv, clock_,
                                   moebius::arena_cursor{0}, s.w.kv_layout);
  return s;
}

engine& run_pool::calibration_engine() {
  if (fixed_.empty()) fixed_.push_back(make_seat(make_sim_world(deployment_kind::switching)));
  return *fixed_.front().eng;
}

engine& run_pool::calibration_engine(deployment_kind k) {
  if (k == deployment_kind::switching) return calibration_engine();
  for (auto& [kind, s] : designs_)
    if (kind == k) return *s.eng;
  designs_.emplace_back(k, make_seat(make_sim_world(k)));
  return *designs_.back().second.eng;
}

const world& run_pool::front_world() {
  calibration_engine();
  return fixed_.front().w;
}

engine& run_pool::engine_for(size_t slot, run_kind k, std::vector<seat>& fresh) {
  if (!per_run_) return *fixed_[slot].eng;
  fresh.push_back(make_seat(make_sim_world(deployment_of(k))));
  return *fresh.back().eng;
}

std::vector<run_outcome> run_pool::serve(const std::vector<request>& trace,
                                         const std::vector<run_spec>& specs, bool announce) {
  std::vector<run_outcome> out(specs.size());
  std::exception_ptr failure;
  std::mutex failure_mutex;
  for (size_t first = 0; first < specs.size(); first += width_) {
    std::vector<seat> fresh;  // simulated: this round's deployments
    fresh.reserve(width_);
    std::vector<engine*> engines;
    for (size_t j = 0; j < width_ && first + j < specs.size(); ++j)
      engines.push_back(&engine_for(j, specs[first + j].kind, fresh));
    std::vector<std::thread> threads;
    for (size_t j = 0; j < engines.size(); ++j) {
      const size_t k = first + j;
      if (announce) std::printf("  %s ...\n", label_of(specs[k].kind));
      std::fflush(stdout);
      threads.emplace_back([&, k, j] {
        try {
          const auto t0 = wall::now();
          out[k].kind = specs[k].kind;
          out[k].result = engines[j]->run(trace, specs[k].options, label_of(specs[k].kind));
          out[k].wall_s = std::chrono::duration<double>(wall::now() - t0).count();
        } catch (...) {
          std::lock_guard<std::mutex> lock(failure_mutex);
          if (!failure) failure = std::current_exception();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    if (failure) std::rethrow_exception(failure);
  }
  for (run_outcome& r : out) r.summary = summarize(r.result);
  return out;
}

}  // namespace mini_engine::demo
