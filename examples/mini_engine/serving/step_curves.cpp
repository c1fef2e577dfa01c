#include "step_curves.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <istream>
#include <iterator>
#include <sstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;
using moebius::parallel_mode;

namespace {

// Order of the configurations: TP, EP first (the paper's pair), then by name.
auto config_key(const configuration& c) {
  const int rank = c == k_tp ? 0 : c == k_ep ? 1 : 2;
  return std::make_tuple(rank, name_of(c));
}

auto key(const step_curve_point& p) {
  return std::make_tuple(config_key(p.mode), p.context, p.batch);
}

// "" when p can be a curve point, else what is wrong with it.
std::string point_error(const step_curve_point& p) {
  if (!is_named(p.mode)) return "has no named configuration (" + name_of(p.mode) + ")";
  if (p.batch >= 1 && p.context >= 1 && p.step_ms > 0 && std::isfinite(p.step_ms)) return "";
  std::ostringstream os;
  os << "needs batch >= 1, context >= 1 and a positive step_ms (got batch " << p.batch
     << ", context " << p.context << ", step_ms " << p.step_ms << ")";
  return os.str();
}

}  // namespace

void step_curves::add_curves(std::vector<curve>& out, std::vector<step_curve_point> points,
                             const std::string& deployment, bool priced,
                             const std::string& source) {
  for (size_t i = 0; i < points.size(); ++i) {
    const std::string error = point_error(points[i]);
    MOEBIUS_CHECK(error.empty(), errc::invalid_argument, "step_curves (", deployment, "): point ",
                  i, " ", error);
  }
  std::sort(points.begin(), points.end(),
            [](const step_curve_point& a, const step_curve_point& b) { return key(a) < key(b); });
  for (size_t i = 1; i < points.size(); ++i) {
    MOEBIUS_CHECK(key(points[i - 1]) != key(points[i]), errc::invalid_argument,
                  "step_curves (", deployment, "): ", name_of(points[i].mode), " context ",
                  points[i].context, " batch ", points[i].batch, " twice");
  }
  for (const step_curve_point& p : points) {
    if (out.empty() || !(out.back().config == p.mode)) {
      for (const curve& c : out)
        MOEBIUS_CHECK(!(c.config == p.mode), errc::invalid_argument, "step_curves (", deployment,
                      "): ", name_of(p.mode), " has a curve already");
      out.push_back(curve{p.mode, {}, priced, source});
    }
    std::vector<row>& rows = out.back().rows;
    if (rows.empty() || rows.back().context != p.context) rows.push_back(row{p.context, {}});
    rows.back().points.push_back(p);
  }
}

step_curves::step_curves(std::vector<step_curve_point> points, std::string deployment)
    : deployment_(std::move(deployment)) {
  add_curves(curves_, std::move(points), deployment_, false, deployment_);
  for (const configuration& m : {k_tp, k_ep}) {
    MOEBIUS_CHECK(find_curve(m) != nullptr, errc::invalid_argument, "step_curves (", deployment_,
                  "): no ", name_of(m), " point");
  }
}

const step_curves::curve* step_curves::find_curve(const configuration& c) const {
  for (const curve& x : curves_)
    if (x.config == c) return &x;
  return nullptr;
}

const step_curves::curve& step_curves::curve_of(const configuration& c) const {
  const curve* x = find_curve(c);
  if (x == nullptr) {
    std::string have;
    for (const curve& y : curves_) have += (have.empty() ? "" : ", ") + name_of(y.config);
    MOEBIUS_FAIL(errc::invalid_argument, "step curves (", deployment_, "): no curve of ",
                 name_of(c), " (curves of ", have,
                 "; with_priced_layouts prices TP-DCPd and TEP[-DCPd] from TP's)");
  }
  return *x;
}

std::vector<configuration> step_curves::configurations() const {
  std::vector<configuration> out;
  for (const curve& c : curves_) out.push_back(c.config);
  return out;
}

bool step_curves::priced(const configuration& c) const { return curve_of(c).priced; }

collective_pricing step_curves::collectives_of(const configuration& c) const {
  return curve_of(c).collectives;
}

const std::string& step_curves::source_of(const configuration& c) const {
  return curve_of(c).source;
}

step_curves step_curves::from_jsonl(std::istream& in, const std::string& source) {
  std::vector<step_curve_point> points;
  // Each configuration's collectives pricing, as its lines say (one per configuration).
  std::vector<std::pair<configuration, collective_pricing>> pricing;
  std::string line, model;
  int P = 0;
  int64_t layers = 0;
  double skew = 0;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      const nlohmann::json j = nlohmann::json::parse(line);
      // Integers must be JSON integers: get<int64_t>() would truncate 1.9 to 1 and take true.
      auto integer = [&](const char* field) {
        const nlohmann::json& v = j.at(field);
        MOEBIUS_CHECK(v.is_number_integer(), errc::invalid_argument, "\"", field,
                      "\" must be an integer (got ", v.dump(), ")");
        return v.get<int64_t>();
      };
      step_curve_point p;
      // bench_mini_engine_rank_share writes "TP", "EP", "TP-dcp2", "TEP", "TEP-dcp2";
      // hand-written files may use lower case.
      p.mode = parse_configuration(j.at("mode").get<std::string>());
      p.context = integer("context");
      p.batch = integer("batch");
      MOEBIUS_CHECK(j.at("step_ms").is_number(), errc::invalid_argument,
                    "\"step_ms\" must be a number");
      p.step_ms = j.at("step_ms").get<double>();
      const std::string error = point_error(p);  // here, so that the error names the line
      MOEBIUS_CHECK(error.empty(), errc::invalid_argument, error);
      const std::string m = j.at("model").get<std::string>();
      const int64_t p_ranks = integer("P");
      const int64_t l = integer("layers");
      const double sk = j.value("skew", 1.0);
      MOEBIUS_CHECK(p_ranks >= 1 && p_ranks <= 1 << 16 && l >= 1, errc::invalid_argument,
                    "needs P in [1, 65536] and layers >= 1 (got P=", p_ranks, ", layers=", l,
                    ")");
      if (points.empty()) {
        model = m;
        P = static_cast<int>(p_ranks);
        layers = l;
        skew = sk;
      }
      MOEBIUS_CHECK(m == model && p_ranks == P && l == layers && sk == skew,
                    errc::invalid_argument, "model ", m, " P=", p_ranks, " layers=", l,
                    " skew ", sk, " where the file began with ", model, " P=", P, " layers=",
                    layers, " skew ", skew, " (one deployment per file)");
      const std::string priced_by = j.value("collectives", std::string("link"));
      MOEBIUS_CHECK(priced_by == "link" || priced_by == "cited", errc::invalid_argument,
                    "\"collectives\" must be \"link\" or \"cited\" (got \"", priced_by, "\")");
      const collective_pricing cp =
          priced_by == "cited" ? collective_pricing::cited : collective_pricing::link;
      auto seen = std::find_if(pricing.begin(), pricing.end(),
                               [&](const auto& x) { return x.first == p.mode; });
      if (seen == pricing.end()) {
        pricing.emplace_back(p.mode, cp);
      } else {
        MOEBIUS_CHECK(seen->second == cp, errc::invalid_argument, name_of(p.mode), " priced by ",
                      name_of(cp), " where its earlier lines say ", name_of(seen->second),
                      " (one collectives pricing per configuration)");
      }
      points.push_back(p);
    } catch (const nlohmann::json::exception& e) {
      MOEBIUS_FAIL(errc::invalid_argument, "line ", n, " of ", source, ": ", e.what());
    } catch (const moebius::error& e) {
      MOEBIUS_FAIL(errc::invalid_argument, "line ", n, " of ", source, ": ", e.what());
    }
  }
  MOEBIUS_CHECK(!points.empty(), errc::invalid_argument, source, ": no curve points");
  std::ostringstream d;
  d << model << " P=" << P << " L=" << layers << " skew " << skew << " (" << source << ")";
  step_curves c(std::move(points), d.str());
  for (curve& x : c.curves_)
    for (const auto& [config, cp] : pricing)
      if (x.config == config) x.collectives = cp;
  c.num_ranks_ = P;
  c.num_layers_ = layers;
  c.model_ = model;
  return c;
}

std::optional<step_curves> step_curves::find(std::span<const embedded_curves> files,
                                             const std::string& model, int P) {
  for (const embedded_curves& f : files) {
    if (f.text == nullptr) continue;
    std::istringstream in(f.text);
    step_curves c = from_jsonl(in, f.source);
    if (c.model() == model && c.num_ranks() == P) return c;
  }
  return std::nullopt;
}

namespace {

// Generated from docs/results/step_curves_*.jsonl (CMakeLists.txt); the last entry is empty so
// that the array exists when no curves have been measured.
constexpr embedded_curves measured_curves[] = {
#include "measured_step_curves.inc"
    {nullptr, nullptr},
};

constexpr embedded_curves region_curves[] = {
#include "measured_step_region.inc"
    {nullptr, nullptr},
};

constexpr embedded_curves layout_ratio_curves[] = {
#include "measured_step_layouts.inc"
    {nullptr, nullptr},
};

}  // namespace

std::span<const embedded_curves> step_curves::measured_files() {
  return {measured_curves, std::size(measured_curves) - 1};
}

std::span<const embedded_curves> step_curves::region_files() {
  return {region_curves, std::size(region_curves) - 1};
}

std::optional<step_curves> step_curves::merge(std::span<const embedded_curves> files,
                                              const std::string& model, int P) {
  std::string text, sources;
  for (const embedded_curves& f : files) {
    if (f.text == nullptr) continue;
    // The file's deployment, from its first line (a file holds one; from_jsonl checks the rest).
    std::istringstream in(f.text);
    std::string first;
    while (std::getline(in, first) && first.find_first_not_of(" \t\r") == std::string::npos) {
    }
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(first);
    } catch (const nlohmann::json::exception& e) {
      MOEBIUS_FAIL(errc::invalid_argument, "line 1 of ", f.source, ": ", e.what());
    }
    if (j.value("model", std::string()) != model || j.value("P", 0) != P) continue;
    text += f.text;
    if (text.back() != '\n') text += '\n';
    sources += (sources.empty() ? "" : " + ") + std::string(f.source);
  }
  if (text.empty()) return std::nullopt;
  std::istringstream in(text);
  return from_jsonl(in, sources);  // a mode missing from every file: an error naming them
}

std::span<const embedded_curves> step_curves::layout_ratio_files() {
  return {layout_ratio_curves, std::size(layout_ratio_curves) - 1};
}

std::optional<step_curves> step_curves::layout_ratios(const std::string& model, int P) {
  return find(layout_ratio_files(), model, P);
}

std::optional<step_curves> step_curves::region(const std::string& model, int P) {
  return merge(region_files(), model, P);
}

std::optional<step_curves> step_curves::measured(const std::string& model, int P) {
  return find(measured_files(), model, P);
}

step_curves step_curves::from_file(const std::string& path) {
  std::ifstream in(path);
  MOEBIUS_CHECK(in.good(), errc::invalid_argument, "step_curves: cannot open ", path);
  return from_jsonl(in, path);
}

double step_curves::smallest_context(const configuration& c) const {
  return static_cast<double>(curve_of(c).rows.front().context);
}

double step_curves::row_ms(const row& r, double batch) {
  const std::vector<step_curve_point>& pts = r.points;
  if (pts.size() == 1 || batch <= static_cast<double>(pts.front().batch)) return pts.front().step_ms;
  for (size_t i = 1; i < pts.size(); ++i) {
    const double b0 = static_cast<double>(pts[i - 1].batch), b1 = static_cast<double>(pts[i].batch);
    if (batch <= b1) {
      const double t = (std::log2(batch) - std::log2(b0)) / (std::log2(b1) - std::log2(b0));
      return pts[i - 1].step_ms + t * (pts[i].step_ms - pts[i - 1].step_ms);
    }
  }
  // Beyond the largest batch: the last segment's slope in the batch.
  const step_curve_point& a = pts[pts.size() - 2];
  const step_curve_point& b = pts.back();
  // Never falling: a last segment that falls by noise would price large batches at 0 ms or less.
  const double slope =
      std::max(0.0, (b.step_ms - a.step_ms) / static_cast<double>(b.batch - a.batch));
  return b.step_ms + slope * (batch - static_cast<double>(b.batch));
}

step_curves step_curves::with_step_shift(
    const std::function<double(const configuration&, int64_t batch)>& shift_ms,
    const std::string& what) const {
  step_curves c = *this;
  for (curve& x : c.curves_) {
    for (row& r : x.rows) {
      for (step_curve_point& p : r.points) {
        p.step_ms += shift_ms(x.config, p.batch);
        MOEBIUS_CHECK(p.step_ms > 0, errc::invalid_argument, "step curves: the ",
                      name_of(p.mode), " step at batch ", p.batch, ", context ", p.context,
                      " falls to ", p.step_ms, " ms with ", what);
      }
    }
  }
  c.deployment_ = deployment_ + ", " + what;
  return c;
}

step_curves step_curves::with_collectives(collective_pricing to, const priced_model& m) const {
  if (std::all_of(curves_.begin(), curves_.end(),
                  [to](const curve& x) { return x.collectives == to; }))
    return *this;
  MOEBIUS_CHECK(num_layers_ >= 1 && num_layers_ == m.num_layers, errc::invalid_argument,
                "step curves: repricing the collectives needs the layers the curves were "
                "measured with, equal to the model's (", deployment_, ": ", num_layers_,
                "; the model: ", m.num_layers, ")");
  const auto shift = [&](const configuration& config, int64_t batch) {
    decode_step_shape s;
    s.tp_attention = config.attention() == parallel_mode::tp;
    s.dcp = config.dcp;
    s.batch = batch;
    s.rank_pairs = s.tp_attention ? 0 : (batch + num_ranks_ - 1) / num_ranks_ * m.top_k;
    s.num_ranks = num_ranks_;
    s.layers = num_layers_;
    s.hidden = m.hidden;
    s.q_heads = m.num_q_heads;
    s.head_dim = m.head_dim;
    return collectives_shift_ms(s, collectives_of(config), to);
  };
  step_curves c = with_step_shift(shift, "collectives priced by " + std::string(name_of(to)) +
                                             (to == collective_pricing::cited
                                                  ? " measurements (collective_table.hpp)"
                                                  : " model (10 us + bytes / link rate)"));
  for (curve& x : c.curves_) x.collectives = to;
  return c;
}

step_curves step_curves::with_expert_load(const priced_model& m, double hbm_bytes_per_s,
                                          const routing_model& routing) const {
  MOEBIUS_CHECK(num_layers_ >= 1 && num_layers_ == m.num_layers, errc::invalid_argument,
                "step curves: pricing the busiest rank's expert load needs the layers the "
                "curves were measured with, equal to the model's (", deployment_, ": ",
                num_layers_, "; the model: ", m.num_layers, ")");
  const auto moved = [](const curve& x) {
    return x.config.experts() == parallel_mode::ep && !x.roofline_experts && !x.expert_load;
  };
  if (std::none_of(curves_.begin(), curves_.end(), moved)) return *this;
  const double expert_bytes = 3.0 * static_cast<double>(m.hidden) *
                              static_cast<double>(m.intermediate) *
                              static_cast<double>(m.weight_bytes);
  std::vector<bool> move;
  for (const curve& x : curves_) move.push_back(moved(x));
  std::ostringstream what;
  what << "the busiest EP rank's expert load priced (routing skew " << routing.skew << ")";
  step_curves c = with_step_shift(
      [&](const configuration& config, int64_t batch) {
        for (size_t i = 0; i < curves_.size(); ++i) {
          if (!(curves_[i].config == config)) continue;
          if (!move[i]) return 0.0;
          return expert_load_shift_ms(config.attention() == parallel_mode::tp, batch,
                                      m.num_experts, num_ranks_, m.top_k, num_layers_,
                                      expert_bytes, hbm_bytes_per_s, routing);
        }
        return 0.0;
      },
      what.str());
  for (size_t i = 0; i < c.curves_.size(); ++i)
    if (move[i]) c.curves_[i].expert_load = true;
  return c;
}

bool step_curves::expert_load_priced(const configuration& c) const { return curve_of(c).expert_load; }

step_curves step_curves::with_collective_latency(double tp_us, double ep_us) const {
  for (const double us : {tp_us, ep_us}) {
    MOEBIUS_CHECK(std::isfinite(us) && us >= 0 && us <= 1e4, errc::invalid_argument,
                  "step curves: a collective's latency must be in [0, 10000] us (got ", us, ")");
  }
  MOEBIUS_CHECK(num_layers_ >= 1, errc::invalid_argument,
                "step curves: repricing the collectives needs the layers the curves were "
                "measured with (", deployment_, " does not say)");
  for (const curve& x : curves_) {
    MOEBIUS_CHECK(x.collectives == collective_pricing::link, errc::invalid_argument,
                  "step curves: repricing the collectives at a latency needs the link model's "
                  "prices, and ", name_of(x.config), "'s are ", name_of(x.collectives),
                  " (with_collectives(link) first)");
  }
  step_curves c = *this;
  for (curve& x : c.curves_) {
    const bool tp = x.config.attention() == parallel_mode::tp;
    const double latency_us = tp ? tp_us : ep_us;
    // Two collectives a layer; DCP's exchange three more (q all-gather, two merges).
    const double per_layer = tp && x.config.dcp > 1 ? 5.0 : 2.0;
    const double shift_ms = per_layer * static_cast<double>(num_layers_) *
                            (latency_us - priced_collective_us) * 1e-3;
    for (row& r : x.rows) {
      for (step_curve_point& p : r.points) {
        p.step_ms += shift_ms;
        MOEBIUS_CHECK(p.step_ms > 0, errc::invalid_argument, "step curves: the ",
                      name_of(p.mode), " step at batch ", p.batch, ", context ", p.context,
                      " falls to ", p.step_ms, " ms with collectives at ", latency_us, " us");
      }
    }
  }
  std::ostringstream d;
  d << deployment_ << ", collectives repriced at " << tp_us << " us (TP) / " << ep_us
    << " us (EP) each";
  c.deployment_ = d.str();
  return c;
}

double step_curves::step_ms(const configuration& c, double batch, double context) const {
  return curve_ms(curve_of(c), batch, context, false);
}

double step_curves::step_ms_within(const configuration& c, double batch, double context) const {
  return curve_ms(curve_of(c), batch, context, true);
}

double step_curves::curve_ms(const curve& x, double batch, double context, bool within) {
  const auto at = [&](const row& r) {
    return row_ms(r, within ? std::min(batch, static_cast<double>(r.points.back().batch)) : batch);
  };
  const std::vector<row>& rows = x.rows;
  if (context <= static_cast<double>(rows.front().context)) return at(rows.front());
  for (size_t i = 1; i < rows.size(); ++i) {
    const double c0 = static_cast<double>(rows[i - 1].context);
    const double c1 = static_cast<double>(rows[i].context);
    if (context <= c1) {
      const double a = at(rows[i - 1]), b = at(rows[i]);
      return a + (b - a) * (context - c0) / (c1 - c0);
    }
  }
  return at(rows.back());  // above the contexts: the nearest
}

}  // namespace mini_engine
