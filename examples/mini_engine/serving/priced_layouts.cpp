// The priced fallbacks for configurations without a measured curve (step_curves.hpp:
// with_priced_layouts, from TP's measured curve; with_measured_ratio, from another layout's curve
// and the two's ratio measured together).
#include <algorithm>
#include <sstream>
#include <vector>

#include <moebius/error.hpp>

#include "step_curves.hpp"

namespace mini_engine {

using moebius::errc;
using moebius::parallel_mode;

step_curves with_priced_layouts(const step_curves& measured, const h200_step_model& model,
                                std::span<const configuration> wanted) {
  MOEBIUS_CHECK(measured.num_layers_ == model.model().num_layers, errc::invalid_argument,
                "with_priced_layouts: the curves (", measured.deployment(), ") have ",
                measured.num_layers_, " layers, the model prices ", model.model().num_layers);
  const step_curves::curve& tp = measured.curve_of(k_tp);
  MOEBIUS_CHECK(!tp.priced, errc::invalid_argument,
                "with_priced_layouts: TP's curve is itself priced");
  // The fallback adds DCP's exchange at the model's link latency: TP's curve must be priced so.
  MOEBIUS_CHECK(tp.collectives == collective_pricing::link, errc::invalid_argument,
                "with_priced_layouts: TP's collectives are priced by ", name_of(tp.collectives),
                " (price the fallback before with_collectives)");
  const double L = static_cast<double>(model.model().num_layers);
  step_curves out = measured;
  for (const configuration& c : wanted) {
    if (out.has(c)) continue;  // measured (or priced already): kept
    MOEBIUS_CHECK(is_named(c) && c.attention() == parallel_mode::tp && !(c == k_tp),
                  errc::invalid_argument, "with_priced_layouts: ", name_of(c),
                  " cannot be priced from TP's curve (TP-DCPd, TEP and TEP-DCPd can)");
    const bool tep = c.experts() == parallel_mode::ep;
    std::vector<step_curve_point> points;
    for (const step_curves::row& r : tp.rows) {
      for (const step_curve_point& p : r.points) {
        const double b = static_cast<double>(p.batch);
        double ms = p.step_ms + L * model.dcp_exchange_s(b, c.dcp) * 1e3;
        if (tep) ms += (model.experts_s(parallel_mode::ep, b) - model.experts_s(parallel_mode::tp, b)) * 1e3;
        points.push_back({c, p.context * c.dcp, p.batch, ms});
      }
    }
    std::ostringstream why;
    why << "priced from TP's curve (" << tp.source << "): TP at context/" << c.dcp;
    if (c.dcp > 1) why << " plus DCP's exchange (3 collectives a layer, bench_rank_share's pricing)";
    if (tep) why << ", EP's expert term instead of TP's (roofline)";
    step_curves::add_curves(out.curves_, std::move(points), out.deployment_, true, why.str());
    out.curves_.back().roofline_experts = tep;
  }
  return out;
}

step_curves with_measured_ratio(const step_curves& curves, const step_curves& ratios,
                                const configuration& c, const configuration& ref) {
  MOEBIUS_CHECK(!(c == ref), errc::invalid_argument, "with_measured_ratio: ", name_of(c),
                " priced from itself");
  const step_curves::curve& base = curves.curve_of(ref);
  MOEBIUS_CHECK(ratios.has(c) && ratios.has(ref), errc::invalid_argument,
                "with_measured_ratio: the ratio curves (", ratios.deployment(), ") need ",
                name_of(c), " and ", name_of(ref));
  if (curves.has(c) && !curves.priced(c)) return curves;  // measured: kept
  std::vector<step_curve_point> points;
  for (const step_curves::row& r : base.rows) {
    for (const step_curve_point& p : r.points) {
      const double b = static_cast<double>(p.batch), ctx = static_cast<double>(p.context);
      const double ratio = ratios.step_ms_within(c, b, ctx) / ratios.step_ms_within(ref, b, ctx);
      points.push_back({c, p.context, p.batch, p.step_ms * ratio});
    }
  }
  std::ostringstream why;
  why << name_of(ref) << "'s curve (" << (base.priced ? "priced: " : "") << base.source
      << ") times " << name_of(c) << "/" << name_of(ref) << " as measured in "
      << ratios.deployment() << " (the ratio of whole steps, held at its points' edge)";
  std::vector<step_curves::curve> priced;
  step_curves::add_curves(priced, std::move(points), curves.deployment_, true, why.str());
  priced.front().collectives = base.collectives;
  step_curves out = curves;
  auto at = std::find_if(out.curves_.begin(), out.curves_.end(),
                         [&](const step_curves::curve& x) { return x.config == c; });
  if (at != out.curves_.end())
    *at = std::move(priced.front());  // the fallback's place: the order of configurations() kept
  else
    out.curves_.push_back(std::move(priced.front()));
  return out;
}

}  // namespace mini_engine
