// The demo's traces: the host demo's small ones at their shapes (experiments.hpp), the
// paper's at full size (serving/paper_traces.hpp), or a file.
#include <moebius/error.hpp>

#include "experiments.hpp"
#include "paper_traces.hpp"

namespace mini_engine::demo {

trace_shapes demo_trace_shapes() {
  trace_shapes t;
  t.bursty.duration_s = 1.4;
  t.bursty.quiet_s = 0.6;
  t.bursty.quiet_rate = 40;
  t.bursty.burst_s = 0.1;
  t.bursty.burst_rate = 5500;
  t.bursty.prompt_min = 8;
  t.bursty.prompt_max = 32;
  t.bursty.output_min = 4;
  t.bursty.output_max = 32;
  t.rollout.prompt_min = 16;
  t.rollout.prompt_max = 48;
  t.rollout.output_median = 32;
  t.rollout.output_sigma = 1.0;
  t.rollout.output_max = 1024;
  t.steady.duration_s = 1.5;
  t.steady.prompt_min = 8;
  t.steady.prompt_max = 32;
  t.steady.output_min = 8;
  t.steady.output_max = 40;
  t.production.duration_s = 3.0;
  t.production.mean_rate = 30;
  t.production.rate_period_s = 0.5;
  t.production.prompt_max = 256;
  t.production.output_max = 512;
  return t;
}

std::vector<request> make_trace(const options& o, trace_kind kind, int32_t vocab,
                                double steady_rate) {
  trace_shapes t = demo_trace_shapes();
  auto duration = [&](double own) { return o.duration_s > 0 ? o.duration_s : own; };
  switch (kind) {
    case trace_kind::bursty:
      t.bursty.duration_s = duration(t.bursty.duration_s);
      t.bursty.vocab = vocab;
      return bursty_trace(o.seed, t.bursty);
    case trace_kind::rollout:
      t.rollout.batch = o.requests;
      t.rollout.vocab = vocab;
      return rollout_trace(o.seed, t.rollout);
    case trace_kind::steady:
      t.steady.duration_s = duration(t.steady.duration_s);
      t.steady.rate = steady_rate;
      t.steady.vocab = vocab;
      return steady_trace(o.seed, t.steady);
    case trace_kind::production:
      t.production.duration_s = duration(t.production.duration_s);
      t.production.prompt_scale = o.context_scale;
      t.production.vocab = vocab;
      return production_trace(o.seed, t.production);
    case trace_kind::paper_bursty: {
      paper_bursty_options b;
      b.vocab = vocab;
      return paper_bursty_trace(o.seed, b);
    }
    case trace_kind::paper_steady: {  // steady_rate: the rate that keeps ~B* running
      paper_steady_options s;
      s.vocab = vocab;
      if (steady_rate > 0) s.rate = steady_rate;
      return paper_steady_trace(o.seed, s);
    }
    case trace_kind::paper_production: {  // steady_rate: the rate that keeps ~B* running
      paper_production_options pr;
      pr.vocab = vocab;
      if (steady_rate > 0) pr.mean_rate = steady_rate;
      return paper_production_trace(o.seed, pr);
    }
    case trace_kind::paper_rollout: {
      paper_rollout_options r;
      r.vocab = vocab;
      if (o.rollout_median >= 0) r.output_median = o.rollout_median;
      if (o.rollout_cut >= 0) r.cut_share = o.rollout_cut;
      return paper_rollout_trace(o.seed, r);
    }
    case trace_kind::file:
      try {
        return read_trace_file(o.trace_file, o.seed, vocab);
      } catch (const moebius::error& e) {
        throw usage_error(std::string("--trace: ") + e.what());
      }
  }
  return {};
}

}  // namespace mini_engine::demo
