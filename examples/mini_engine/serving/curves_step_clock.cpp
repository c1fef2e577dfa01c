#include "curves_step_clock.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;
using moebius::parallel_mode;

namespace {

// What the clock prices beyond the decode curves, for its name.
std::string clock_options_text(const curves_clock_options& o) {
  std::ostringstream os;
  if (o.replayed_decode) {
    std::string configs;
    for (const configuration& c : o.replayed_decode->configurations())
      configs += (configs.empty() ? "" : ", ") + name_of(c);
    os << "decode steps at their own batch on decode steps measured as replayed (every graph "
          "bucket and the first batch past each) of "
       << configs << " (" << o.replayed_decode->deployment() << ")";
  } else if (o.graph_buckets.empty()) {
    os << "decode steps at their own batch (between the measured points)";
  } else {
    os << "decode steps at their CUDA-graph bucket (" << o.graph_buckets.size() << " buckets, "
       << o.graph_buckets.front() << "-" << o.graph_buckets.back() << "; beyond: eager, the curve x "
       << o.eager_penalty << ")";
  }
  std::string mixed;
  for (const configuration& c : o.mixed.configurations())
    mixed += (mixed.empty() ? "" : ", ") + name_of(c);
  if (!mixed.empty()) {
    os << ", a step that prefills priced whole from measured mixed steps (decode batch x chunk "
          "tokens) of "
       << mixed << " (" << o.mixed.source() << "; decode context " << o.mixed.decode_context()
       << ")";
  }
  std::string measured, rows;
  for (const configuration& c : o.prefill.configurations())
    measured += (measured.empty() ? "" : ", ") + name_of(c);
  if (measured.empty()) {
    os << ", a prefill chunk's tokens as extra rows of the curve at its smallest context, not "
          "measured";
  } else {
    os << ", a prefill chunk from measured prefill steps of " << measured << " ("
       << o.prefill.source() << "; other configurations: extra rows of the curve, not measured)";
  }
  return os.str();
}

}  // namespace

curves_step_clock::curves_step_clock(step_curves curves, const h200_step_model& model,
                                     curves_clock_options options)
    : curves_(std::move(curves)), model_(model), options_(std::move(options)) {
  validate_graph_buckets(options_.graph_buckets);
  MOEBIUS_CHECK(std::isfinite(options_.eager_penalty) && options_.eager_penalty > 0,
                errc::invalid_argument, "curves_step_clock: eager_penalty ",
                options_.eager_penalty, " must be finite and > 0");
  if (options_.replayed_decode) {
    MOEBIUS_CHECK(options_.graph_buckets.empty(), errc::invalid_argument,
                  "curves_step_clock: replayed_decode and graph_buckets are two ways to price a "
                  "graph's padding: give one");
    for (const configuration& c : options_.replayed_decode->configurations())
      MOEBIUS_CHECK(curves_.has(c), errc::invalid_argument, "curves_step_clock: replayed_decode has ",
                    name_of(c), ", which the curves (", curves_.deployment(), ") have no curve of");
  }
  name_ = "per-rank step curves of " + curves_.deployment() +
          " (compute measured on one GPU, collectives priced; EP steps by their busiest rank; " +
          clock_options_text(options_) + "); switches and overlap: " + model.name();
}

double curves_step_clock::rank_ms(const configuration& m, double ranks, int64_t sequences,
                                  int64_t rows, double context, bool graphs) const {
  const double seqs = static_cast<double>(sequences);
  if (rows <= sequences) {
    if (graphs && options_.replayed_decode && options_.replayed_decode->has(m))
      return options_.replayed_decode->step_ms(m, ranks * seqs, context);
    if (!graphs || options_.graph_buckets.empty()) return curves_.step_ms(m, ranks * seqs, context);
    // The replayed graph runs the bucket's rows; beyond the largest bucket, eagerly.
    const int64_t bucket = graph_bucket(options_.graph_buckets, sequences);
    if (bucket == 0) return curves_.step_ms(m, ranks * seqs, context) * options_.eager_penalty;
    return curves_.step_ms(m, ranks * static_cast<double>(bucket), context);
  }
  if (options_.mixed.has(m)) return mixed_ms(m, ranks, sequences, rows, context);
  const double decode = curves_.step_ms(m, ranks * seqs, context);
  // The prefill increment at the smallest measured context (a prefill chunk's attention is
  // compute-bound over its own tokens, not a read of the KV per row).
  const double ctx0 = curves_.smallest_context(m);
  const double beside = curves_.step_ms(m, ranks * seqs, ctx0);
  const double chunk = options_.prefill.has(m)
                           ? options_.prefill.step_ms(m, static_cast<double>(rows))
                           : curves_.step_ms(m, ranks * static_cast<double>(rows), ctx0);
  return decode + std::max(0.0, chunk - beside);
}

double curves_step_clock::mixed_ms(const configuration& m, double ranks, int64_t sequences,
                                   int64_t rows, double context) const {
  const mixed_step_table& mixed = options_.mixed;
  // One chunk assumed (the header): the other items decode.
  const int64_t b = sequences - 1;
  const int64_t t = rows - b;
  const double seqs = static_cast<double>(sequences);
  const double at_grid = static_cast<double>(mixed.decode_context());
  double ms = mixed.step_ms(m, static_cast<double>(b), static_cast<double>(t));
  ms += std::max(0.0, curves_.step_ms(m, ranks * seqs, context) -
                          curves_.step_ms(m, ranks * seqs, at_grid));
  const int64_t bmax = mixed.largest_batch(m);
  if (b > bmax) {
    const double ctx0 = curves_.smallest_context(m);
    ms += std::max(0.0, curves_.step_ms(m, ranks * static_cast<double>(b), ctx0) -
                            curves_.step_ms(m, ranks * static_cast<double>(bmax), ctx0));
  }
  return ms;
}

double curves_step_clock::step_s(const step_cost& c, double measured_s) const {
  if (c.num_sequences <= 0) return model_.step_s(c, measured_s);
  const double scale = model_.model().context_scale;
  const configuration config = c.config();
  // Graphs are replayed for pure decode steps only (every item one new token).
  const bool graphs = c.new_tokens <= c.num_sequences;
  std::vector<rank_work> even;
  const std::vector<rank_work>* split = &c.ranks;
  if (c.mode == parallel_mode::ep && c.ranks.empty() && c.num_ranks > 1 &&
      !options_.graph_buckets.empty()) {
    // No split given: each rank's bucket as if the items split evenly.
    const int64_t P = c.num_ranks;
    even.assign(static_cast<size_t>(P),
                rank_work{(c.num_sequences + P - 1) / P, (c.new_tokens + P - 1) / P,
                          (c.context_tokens + P - 1) / P});
    split = &even;
  }
  if (c.mode == parallel_mode::ep && !split->empty()) {
    // Data-parallel attention: the step waits for its busiest rank, each rank priced as if
    // every rank held its share (the curves' batch is the deployment's: P x the rank's).
    const double P = static_cast<double>(split->size());
    double worst = 0;
    for (const rank_work& r : *split) {
      if (r.sequences <= 0) continue;
      const double seqs = static_cast<double>(r.sequences);
      worst = std::max(worst, rank_ms(config, P, r.sequences, r.new_tokens,
                                      static_cast<double>(r.context_tokens) / seqs * scale, graphs));
    }
    return worst * 1e-3;
  }
  const double seqs = static_cast<double>(c.num_sequences);
  return rank_ms(config, 1, c.num_sequences, c.new_tokens,
                 static_cast<double>(c.context_tokens) / seqs * scale, graphs) *
         1e-3;
}

double curves_step_clock::switch_s(const moebius::switch_report& r) const { return model_.switch_s(r); }
int64_t curves_step_clock::layer_bytes(const moebius::layer_bytes& run, int64_t run_layers) const {
  return model_.layer_bytes(run, run_layers);
}
moebius::link_rate curves_step_clock::link() const { return model_.link(); }
double curves_step_clock::copies_s(const switch_copies& copies) const { return model_.copies_s(copies); }
double curves_step_clock::predicted_switch_s(const moebius::layer_bytes& run,
                                             int64_t run_layers) const {
  return model_.predicted_switch_s(run, run_layers);
}

double curves_step_clock::predicted_kv_switch_s(const moebius::layer_bytes& run,
                                                int64_t run_layers) const {
  return model_.predicted_kv_switch_s(run, run_layers);
}
overlap_slowdown curves_step_clock::slowdown() const { return model_.slowdown(); }

}  // namespace mini_engine
