#include "engine.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <cstdio>
#include <ostream>

#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>
#include <moebius/switch/pacing.hpp>

#include "kv_pages.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::kv_state;
using moebius::parallel_mode;

namespace {

using host_clock = std::chrono::steady_clock;

double seconds_since(host_clock::time_point t0) {
  return std::chrono::duration<double>(host_clock::now() - t0).count();
}

parallel_mode other(parallel_mode m) {
  return m == parallel_mode::ep ? parallel_mode::tp : parallel_mode::ep;
}

kv_state empty_tables(const moebius::kv_geometry& g, parallel_mode m) {
  kv_state s;
  s.mode = m;
  s.ranks.resize(static_cast<size_t>(g.num_ranks));
  for (moebius::kv_rank_state& r : s.ranks) {
    r.free_pages.resize(static_cast<size_t>(g.num_pages(m)));
    for (size_t p = 0; p < r.free_pages.size(); ++p) r.free_pages[p] = static_cast<int64_t>(p);
  }
  return s;
}

int64_t used_pages_all(const moebius::kv_geometry& g, const kv_state& s) {
  int64_t used = 0;
  for (int r = 0; r < g.num_ranks; ++r) used += moebius::used_pages(g, s, r);
  return used;
}

bool no_live_sequences(const kv_state& s) {
  return std::all_of(s.ranks.begin(), s.ranks.end(),
                     [](const moebius::kv_rank_state& r) { return r.sequences.empty(); });
}

// The policy's capacity check: the switcher's (today's tables) and the scheduler's
// (every running sequence at its largest).
struct capacity_context {
  const moebius::switcher* sw;
  const scheduler* sched;
};

bool fits(void* c, parallel_mode target) {
  const auto* ctx = static_cast<const capacity_context*>(c);
  return ctx->sw->check(target).fits && ctx->sched->fits_at_largest(ctx->sw->kv_tables(), target);
}

int64_t tokens_produced(const scheduler& sched) {
  int64_t n = 0;
  for (const request_result& q : sched.results()) n += static_cast<int64_t>(q.generated.size());
  return n;
}

}  // namespace

engine::engine(runtime& rt, moebius::transport& t, const moebius::arena_geometry& arena,
               const moebius::kv_geometry& kv, const step_clock& clock,
               moebius::arena_cursor cursor)
    : runtime_(rt),
      arena_(arena),
      kv_(kv),
      clock_(clock),
      switcher_(arena, kv, t,
                empty_tables(kv, cursor.tp_layers == 0 ? parallel_mode::ep : parallel_mode::tp),
                cursor, [this] {
                  moebius::switcher_options o;
                  o.verify = [this](moebius::arena_cursor c, const kv_state& s) -> uint64_t {
                    return verify_ ? verify_(c, s) : 0;
                  };
                  return o;
                }()) {}

void engine::end_progressive(progressive_state& p, run_result& out, scheduler& sched, double now,
                             const std::string& name) {
  const moebius::switch_report& r = switcher_.progress_report();
  switch_record& s = out.switches[p.record];
  s.outcome = r.outcome;
  s.error = r.error;
  s.measured_ms = r.total_ms;
  s.clock_ms = (now - s.start_s) * 1e3;
  s.tokens = tokens_produced(sched) - p.tokens_before;
  MOEBIUS_CHECK(r.outcome != moebius::switch_outcome::inconsistent, errc::internal,
                "engine::run '", name, "': the progressive switch left the engine inconsistent: ",
                r.error);
  sched.release_deferred(switcher_.mutable_kv_tables());
  p.active = false;
}

void engine::switch_untimed(parallel_mode target) {
  if (switcher_.mode() == target) return;
  const moebius::switch_report r = switcher_.switch_to(target);
  MOEBIUS_CHECK(r.outcome == moebius::switch_outcome::committed, errc::internal,
                "engine: switch to ", moebius::to_string(target), " with no live sequence failed: ",
                moebius::to_string(r.outcome), " ", r.error);
}

run_result engine::run(std::vector<request> requests, const engine_options& o,
                       const std::string& name) {
  MOEBIUS_CHECK(no_live_sequences(switcher_.kv_tables()), errc::invalid_argument,
                "engine::run: the KV tables still hold live sequences");
  MOEBIUS_CHECK(std::is_sorted(o.forced_steps.begin(), o.forced_steps.end()),
                errc::invalid_argument, "engine::run: forced_steps must be ascending");
  verify_ = o.verify;
  switch_untimed(o.start_mode);

  scheduler sched(kv_, std::move(requests), o.scheduler);
  capacity_context cap{&switcher_, &sched};
  std::optional<moebius::switch_policy> policy;
  if (o.how == switching::policy) policy.emplace(o.policy, moebius::capacity_check{&fits, &cap});

  run_result out;
  out.name = name;
  out.clock = clock_.name();
  double now = 0;
  size_t next_forced = 0;
  progressive_state prog;
  double last_step_s = 0;  // the last normal step on the serving clock (pacing)
  const int64_t total = static_cast<int64_t>(sched.results().size());
  for (int64_t step = 0; !sched.done(); ++step) {
    MOEBIUS_CHECK(step < o.max_steps, errc::internal, "engine::run '", name, "': more than ",
                  o.max_steps, " steps (", sched.num_finished(), " of ", total, " finished)");
    // Idle: nothing runs, jump the clock to the next arrival.
    if (sched.num_running() == 0 && sched.next_arrival_s() > now) now = sched.next_arrival_s();

    step_record rec;
    rec.step = step;
    // Between two steps: decide and switch (not while a progressive switch runs).
    bool want = false;
    parallel_mode target = switcher_.mode();
    if (prog.active) {
    } else if (o.how == switching::policy) {
      const int64_t load = std::min(sched.num_running() + sched.num_waiting(now),
                                    o.scheduler.max_running);
      const moebius::switch_decision d = policy->step(load, switcher_.mode(), now);
      want = d.do_switch;
      target = d.target;
    } else if (o.how == switching::forced) {
      while (next_forced < o.forced_steps.size() && o.forced_steps[next_forced] < step) ++next_forced;
      if (next_forced < o.forced_steps.size() && o.forced_steps[next_forced] == step) {
        want = true;
        target = other(switcher_.mode());
      }
    }
    if (want && target != switcher_.mode()) {
      switch_record s;
      s.step = step;
      s.start_s = now;
      s.running = sched.num_running();
      s.prefilling = sched.num_prefilling();
      s.from = switcher_.mode();
      s.to = target;
      bool stop_the_world = o.style == switch_style::stop_the_world;
      if (!stop_the_world) {
        // Pacing from the last step's time, the clock's link and bytes per layer.
        const int64_t L = arena_.shape.num_layers;
        moebius::kv_migration_options kvo;  // as the switcher plans it (switcher_options)
        kvo.staging.space = moebius::memory_space::arena;
        kvo.staging.offset = 0;
        kvo.staging.bytes = arena_.slot_bytes;
        std::optional<moebius::layer_bytes> lb;
        try {
          lb = moebius::switch_layer_bytes(arena_, kv_, switcher_.kv_tables(), target, kvo);
        } catch (const moebius::error& e) {
          if (e.code() != errc::capacity) throw;
        }
        if (lb) {
          prog.pacing.step_s = last_step_s > 0 ? last_step_s : 0.01;
          prog.pacing.link = clock_.link();
          prog.pacing.link_fraction = o.copy_link_fraction;
          prog.pacing.bytes_per_layer = clock_.layer_bytes(*lb, L);
          prog.layers = moebius::layers_per_step(prog.pacing, L);
          const int64_t steps = (L + prog.layers - 1) / prog.layers;
          try {
            sched.reserve_for_switch(switcher_.mutable_kv_tables(), steps);
          } catch (const moebius::error& e) {
            if (e.code() != errc::capacity) throw;
            lb.reset();  // the pages are not there: stop the world instead
          }
        }
        if (!lb) {
          stop_the_world = true;
        } else {
          const moebius::switch_report r = switcher_.begin(target);
          if (r.outcome == moebius::switch_outcome::in_progress) {
            s.progressive = true;
            s.layers_per_step = prog.layers;
            prog.active = true;
            prog.record = out.switches.size();
            prog.tokens_before = tokens_produced(sched);
          } else {
            MOEBIUS_CHECK(r.outcome != moebius::switch_outcome::inconsistent, errc::internal,
                          "engine::run '", name, "': begin left the engine inconsistent: ",
                          r.error);
            s.outcome = r.outcome;
            s.error = r.error;
            s.measured_ms = r.total_ms;
          }
        }
      }
      if (stop_the_world) {
        const moebius::switch_report r = switcher_.switch_to(target);
        s.from = r.from;
        s.to = r.to;
        s.outcome = r.outcome;
        s.error = r.error;
        s.measured_ms = r.total_ms;
        s.clock_ms = clock_.switch_s(r) * 1e3;
        MOEBIUS_CHECK(r.outcome != moebius::switch_outcome::inconsistent, errc::internal,
                      "engine::run '", name, "': switch left the engine inconsistent: ", r.error);
        now += s.clock_ms * 1e-3;
        if (r.outcome == moebius::switch_outcome::committed) {
          rec.switched = true;
          rec.switch_ms = s.clock_ms;
        }
      }
      out.switches.push_back(std::move(s));
    }

    // Progressive: the next layers move before the step (on the host the copies complete
    // inside advance(); on a GPU they would run on the copy streams beside the step, the
    // step ordered after the layers it reads: see step.hpp).
    double copy_s = 0;
    if (prog.active) {
      if (o.before_advance) o.before_advance(switcher_, step);
      const auto ta = host_clock::now();
      rec.layers = switcher_.advance(prog.layers);
      while (!switcher_.poll()) {
      }
      const double measured_copy = seconds_since(ta);
      copy_s = clock_.needs_measurement() ? measured_copy
                                          : moebius::copy_seconds(prog.pacing, rec.layers);
      if (!switcher_.in_progress()) {  // the advance failed: rolled back to the start
        end_progressive(prog, out, sched, now, name);
      } else if (o.abort_after_advance && o.abort_after_advance(switcher_, step)) {
        switcher_.abort();
        end_progressive(prog, out, sched, now, name);
      }
    }

    const bool frozen = prog.active;
    kv_state& tables = switcher_.mutable_kv_tables();
    rec.start_s = now;
    const step_batch b = frozen ? sched.next_step_frozen(tables) : sched.next_step(tables, now);
    if (b.empty() && !frozen) continue;  // arrivals only in the future: the idle jump above
    const step_layout layout =
        frozen ? step_layout::hybrid_of(switcher_.tables_for(parallel_mode::tp),
                                        switcher_.tables_for(parallel_mode::ep),
                                        switcher_.cursor())
               : step_layout{&tables, switcher_.cursor()};
    rec.in_switch = frozen;
    rec.cursor = switcher_.cursor().tp_layers;
    std::vector<int32_t> tokens;
    double dt = 0, measured = 0;
    if (!b.empty()) {
      const auto t0 = host_clock::now();
      tokens = runtime_.step(layout, b.items);
      measured = seconds_since(t0);
      // A runtime that times itself (the GPU runtime: CUDA events) reports the device time.
      if (runtime_.measured_step_s() >= 0) measured = runtime_.measured_step_s();
      step_cost cost;
      cost.mode = tables.mode;
      if (frozen && switcher_.cursor().tp_layers * 2 >= arena_.shape.num_layers)
        cost.mode = parallel_mode::tp;  // a hybrid step: priced as its majority mode
      cost.num_ranks = kv_.num_ranks;
      cost.num_sequences = b.num_sequences;
      cost.new_tokens = b.decode_tokens + b.prefill_tokens;
      cost.context_tokens = b.context_tokens;
      dt = clock_.step_s(cost, measured);
      if (!frozen) last_step_s = dt;
    }
    // The copies overlap the step: the step lasts the longer of the two.
    rec.copy_ms = copy_s * 1e3;
    dt = std::max(dt, copy_s);
    rec.mode = tables.mode;
    rec.sequences = b.num_sequences;
    rec.decode_tokens = b.decode_tokens;
    rec.prefill_tokens = b.prefill_tokens;
    rec.context_tokens = b.context_tokens;
    rec.running = sched.num_running();
    rec.waiting = sched.num_waiting(now);
    rec.stalled = b.stalled;
    rec.kv_used_pages = used_pages_all(kv_, tables);
    rec.step_ms = dt * 1e3;
    rec.measured_ms = measured * 1e3;
    out.stalls += b.stalled;
    now += dt;
    if (!b.empty()) sched.finish_step(b, tokens, tables, now, frozen);
    if (frozen) {
      ++out.switches[prog.record].steps;
      if (switcher_.layers_remaining() == 0) {
        switcher_.finish();
        end_progressive(prog, out, sched, now, name);
      }
    }
    if (o.validate_every_step) moebius::validate(kv_, switcher_.kv_tables());
    out.steps.push_back(rec);
    if (o.on_progress && o.progress_every_steps > 0 && step % o.progress_every_steps == 0) {
      progress_info p;
      p.run = &out.name;
      p.step = step;
      p.now_s = now;
      p.running = sched.num_running();
      p.finished = sched.num_finished();
      p.total = total;
      p.mode = switcher_.mode();
      p.switches = static_cast<int64_t>(out.switches.size());
      o.on_progress(p);
    }
  }
  if (prog.active) {  // every request finished during the switch: move the rest, commit
    switcher_.finish();
    end_progressive(prog, out, sched, now, name);
  }
  MOEBIUS_CHECK(no_live_sequences(switcher_.kv_tables()), errc::internal, "engine::run '", name,
                "': pages still in use after every request finished (a leak)");
  moebius::validate(kv_, switcher_.kv_tables());
  out.requests = sched.results();
  out.end_s = now;
  verify_ = nullptr;
  return out;
}

double engine::decode_step_s(parallel_mode mode, int64_t batch, int64_t context) {
  MOEBIUS_CHECK(batch >= 1 && context >= 1, errc::invalid_argument,
                "decode_step_s: need batch >= 1 and context >= 1 (got ", batch, ", ", context, ")");
  step_cost cost;
  cost.mode = mode;
  cost.num_ranks = kv_.num_ranks;
  cost.num_sequences = batch;
  cost.new_tokens = batch;
  cost.context_tokens = batch * (context + 1);
  if (!clock_.needs_measurement()) return clock_.step_s(cost, 0.0);

  MOEBIUS_CHECK(no_live_sequences(switcher_.kv_tables()), errc::invalid_argument,
                "decode_step_s: the KV tables still hold live sequences");
  switch_untimed(mode);
  kv_state& tables = switcher_.mutable_kv_tables();
  // Placeholder sequences far above any request id; EP owners round-robin.
  constexpr int64_t first_id = int64_t{1} << 60;
  const std::vector<int32_t> token(1, 0);
  std::vector<step_item> items;
  for (int64_t i = 0; i < batch; ++i) {
    reserve_tokens(kv_, tables, first_id + i, context + 1, static_cast<int>(i % kv_.num_ranks));
    step_item it;
    it.seq_id = first_id + i;
    it.tokens = token;
    it.start_position = context;
    it.sample = true;
    items.push_back(it);
  }
  const auto t0 = host_clock::now();
  runtime_.step(step_layout{&tables, switcher_.cursor()}, items);
  const double measured =
      runtime_.measured_step_s() >= 0 ? runtime_.measured_step_s() : seconds_since(t0);
  for (int64_t i = 0; i < batch; ++i) release_sequence(tables, first_id + i);
  return clock_.step_s(cost, measured);
}

moebius::calibration_result calibrate_engine(engine& e, std::span<const int64_t> batches,
                                             int64_t context,
                                             const moebius::calibration_options& options) {
  std::vector<moebius::latency_sample> ep, tp;
  for (const int64_t b : batches) {
    ep.push_back({static_cast<double>(b), e.decode_step_s(parallel_mode::ep, b, context) * 1e3});
    tp.push_back({static_cast<double>(b), e.decode_step_s(parallel_mode::tp, b, context) * 1e3});
  }
  return moebius::calibrate(ep, tp, options);
}

run_summary summarize(const run_result& r) {
  run_summary s;
  s.requests = static_cast<int64_t>(r.requests.size());
  s.steps = static_cast<int64_t>(r.steps.size());
  s.duration_s = r.end_s;
  std::vector<double> ttft;
  double tpot_sum = 0;
  int64_t tpot_n = 0;
  for (const request_result& q : r.requests) {
    s.output_tokens += static_cast<int64_t>(q.generated.size());
    if (q.first_token_s >= 0) ttft.push_back(q.ttft_s() * 1e3);
    if (q.finished() && q.output_tokens > 1) {
      tpot_sum += q.tpot_s() * 1e3;
      ++tpot_n;
    }
  }
  if (!ttft.empty()) {
    double sum = 0;
    for (double x : ttft) sum += x;
    s.mean_ttft_ms = sum / static_cast<double>(ttft.size());
    std::sort(ttft.begin(), ttft.end());
    // Nearest rank: the smallest value with at least 99% of the samples at or below it.
    const size_t rank = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(ttft.size())));
    s.p99_ttft_ms = ttft[std::max<size_t>(rank, 1) - 1];
  }
  s.mean_tpot_ms = tpot_n > 0 ? tpot_sum / static_cast<double>(tpot_n) : 0;
  // Throughput over the time requests were present: first arrival to last finish.
  double first_arrival = r.end_s;
  for (const request_result& q : r.requests) first_arrival = std::min(first_arrival, q.arrival_s);
  const double span = r.end_s - first_arrival;
  s.tokens_per_s = span > 0 ? static_cast<double>(s.output_tokens) / span : 0;
  for (const switch_record& w : r.switches) {
    if (w.outcome != moebius::switch_outcome::committed) continue;
    ++s.switches;
    s.switch_total_ms += w.clock_ms;
  }
  s.switch_mean_ms = s.switches > 0 ? s.switch_total_ms / static_cast<double>(s.switches) : 0;
  return s;
}

void write_steps_csv(std::ostream& os, const run_result& r) {
  os << "run,step,start_s,mode,sequences,decode_tokens,prefill_tokens,context_tokens,running,"
        "waiting,stalled,kv_used_pages,step_ms,measured_ms,switched,switch_ms\n";
  char buf[320];
  for (const step_record& s : r.steps) {
    std::snprintf(buf, sizeof buf, "%s,%lld,%.6f,%s,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%.4f,%.4f,%d,%.4f\n",
                  r.name.c_str(), static_cast<long long>(s.step), s.start_s,
                  moebius::to_string(s.mode), static_cast<long long>(s.sequences),
                  static_cast<long long>(s.decode_tokens), static_cast<long long>(s.prefill_tokens),
                  static_cast<long long>(s.context_tokens), static_cast<long long>(s.running),
                  static_cast<long long>(s.waiting), static_cast<long long>(s.stalled),
                  static_cast<long long>(s.kv_used_pages), s.step_ms, s.measured_ms,
                  s.switched ? 1 : 0, s.switch_ms);
    os << buf;
  }
}

}  // namespace mini_engine
