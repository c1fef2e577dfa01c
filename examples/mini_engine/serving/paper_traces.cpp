#include "paper_traces.hpp"

#include <algorithm>
#include <cmath>
#include <moebius/error.hpp>
#include <random>

namespace mini_engine {

using moebius::errc;

namespace {

// Phi(z): the standard normal's CDF.
double normal_cdf(double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); }

// z with Phi(z) = p, for 0 < p < 1 (Acklam's rational approximation refined by one Halley
// step: below 1e-12 relative error, far under what a trace needs).
double normal_quantile(double p) {
  static constexpr double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,
                                 -2.759285104469687e+02, 1.383577518672690e+02,
                                 -3.066479806614716e+01, 2.506628277459239e+00};
  static constexpr double b[] = {-5.447609879822406e+01, 1.615858368580409e+02,
                                 -1.556989798598866e+02, 6.680131188771972e+01,
                                 -1.328068155288572e+01};
  static constexpr double c[] = {-7.784894002430293e-03, -3.223964580411365e-01,
                                 -2.400758277161838e+00, -2.549732539343734e+00,
                                 4.374664141464968e+00,  2.938163982698783e+00};
  static constexpr double d[] = {7.784695709041462e-03, 3.224671290700398e-01,
                                 2.445134137142996e+00, 3.754408661907416e+00};
  double x;
  if (p < 0.02425) {
    const double q = std::sqrt(-2 * std::log(p));
    x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  } else if (p > 1 - 0.02425) {
    const double q = std::sqrt(-2 * std::log(1 - p));
    x = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  } else {
    const double q = p - 0.5, r = q * q;
    x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
  }
  const double e = normal_cdf(x) - p;
  const double u = e * std::sqrt(2 * M_PI) * std::exp(x * x / 2);
  return x - u / (1 + x * u / 2);
}

// A log-normal draw with the given mean (not median) and sigma of the log, rounded and
// clamped to [1, max].
int64_t lognormal_length(std::mt19937_64& rng, double mean, double sigma, int64_t max) {
  std::lognormal_distribution<double> d(std::log(mean) - 0.5 * sigma * sigma, sigma);
  return std::clamp<int64_t>(std::llround(d(rng)), 1, max);
}

// Poisson arrivals in each period, LMSYS-shaped lengths: the bursty and steady traces.
struct chat_lengths {
  double prompt_mean, output_mean, sigma;
  int64_t prompt_max, output_max;
  int32_t vocab;
};

// Throws errc::invalid_argument naming `who`'s field unless the lengths make sense.
void validate(const chat_lengths& len, const char* who) {
  MOEBIUS_CHECK(len.prompt_mean >= 1 && len.output_mean >= 1 && std::isfinite(len.prompt_mean) &&
                    std::isfinite(len.output_mean),
                errc::invalid_argument, who, ": the mean lengths must be >= 1 (got ",
                len.prompt_mean, ", ", len.output_mean, ")");
  MOEBIUS_CHECK(std::isfinite(len.sigma) && len.sigma >= 0, errc::invalid_argument, who,
                ": length_sigma must be >= 0 (got ", len.sigma, ")");
  MOEBIUS_CHECK(len.prompt_max >= 1 && len.output_max >= 1 && len.vocab >= 1,
                errc::invalid_argument, who,
                ": prompt_max, output_max and vocab must be >= 1");
}

// The lengths of paper_bursty_options or paper_steady_options (the same fields).
template <class Options>
chat_lengths lengths_of(const Options& o) {
  return {o.prompt_mean, o.output_mean, o.length_sigma, o.prompt_max, o.output_max, o.vocab};
}

std::vector<request> chat_requests(uint64_t seed, const std::vector<trace_period>& periods,
                                   const chat_lengths& len) {
  std::mt19937_64 rng(seed);
  std::vector<request> out;
  for (const trace_period& p : periods) {
    if (p.rate <= 0) continue;
    std::exponential_distribution<double> gap(p.rate);
    for (double a = p.start_s + gap(rng); a < p.end_s; a += gap(rng)) {
      request r;
      r.id = static_cast<int64_t>(out.size());
      r.arrival_s = a;
      const int64_t prompt = lognormal_length(rng, len.prompt_mean, len.sigma, len.prompt_max);
      r.output_tokens = lognormal_length(rng, len.output_mean, len.sigma, len.output_max);
      r.prompt = draw_prompt(seed, r.id, prompt, len.vocab);
      out.push_back(std::move(r));
    }
  }
  return out;
}

}  // namespace

void validate(const paper_bursty_options& o) {
  MOEBIUS_CHECK(o.target_requests >= 1, errc::invalid_argument,
                "paper_bursty_options: target_requests must be >= 1 (got ", o.target_requests, ")");
  MOEBIUS_CHECK(std::isfinite(o.duration_s) && o.duration_s > 0, errc::invalid_argument,
                "paper_bursty_options: duration_s must be finite and > 0 (got ", o.duration_s, ")");
  MOEBIUS_CHECK(std::isfinite(o.quiet_rate) && o.quiet_rate >= 0, errc::invalid_argument,
                "paper_bursty_options: quiet_rate must be finite and >= 0 (got ", o.quiet_rate,
                ")");
  for (const double r : o.flood_rates) {
    MOEBIUS_CHECK(std::isfinite(r) && r > o.quiet_rate, errc::invalid_argument,
                  "paper_bursty_options: each flood rate must be finite and above quiet_rate ",
                  o.quiet_rate, " (got ", r, ")");
  }
  MOEBIUS_CHECK(std::isfinite(o.quiet_between_s) && o.quiet_between_s >= 0 &&
                    o.quiet_between_s < o.duration_s,
                errc::invalid_argument, "paper_bursty_options: quiet_between_s must be in [0, ",
                o.duration_s, ") (got ", o.quiet_between_s, ")");
  validate(lengths_of(o), "paper_bursty_options");
}

void validate(const paper_rollout_options& o) {
  MOEBIUS_CHECK(o.steps >= 1 && o.prompts_per_step >= 1, errc::invalid_argument,
                "paper_rollout_options: steps and prompts_per_step must be >= 1 (got ", o.steps,
                ", ", o.prompts_per_step, ")");
  MOEBIUS_CHECK(o.output_cap >= 2, errc::invalid_argument,
                "paper_rollout_options: output_cap must be >= 2 (got ", o.output_cap, ")");
  MOEBIUS_CHECK(std::isfinite(o.output_median) && o.output_median >= 1 &&
                    o.output_median < static_cast<double>(o.output_cap),
                errc::invalid_argument, "paper_rollout_options: output_median must be in [1, ",
                o.output_cap, ") (got ", o.output_median, ")");
  MOEBIUS_CHECK(o.cut_share > 0 && o.cut_share < 0.5, errc::invalid_argument,
                "paper_rollout_options: cut_share must be in (0, 0.5) (got ", o.cut_share, ")");
  MOEBIUS_CHECK(1 <= o.prompt_min && o.prompt_min <= o.prompt_max && o.vocab >= 1,
                errc::invalid_argument,
                "paper_rollout_options: need 1 <= prompt_min <= prompt_max and vocab >= 1 (got ",
                o.prompt_min, ", ", o.prompt_max, ", ", o.vocab, ")");
}

double paper_flood_length_s(const paper_bursty_options& o) {
  validate(o);
  // quiet_rate (duration - 2 t) + (r1 + r2) t = target_requests
  const double t = (static_cast<double>(o.target_requests) - o.quiet_rate * o.duration_s) /
                   (o.flood_rates[0] + o.flood_rates[1] - 2 * o.quiet_rate);
  MOEBIUS_CHECK(t > 0 && 2 * t + o.quiet_between_s <= o.duration_s, errc::invalid_argument,
                "paper_bursty_options: no flood length fits: ", o.target_requests,
                " requests at quiet ", o.quiet_rate, "/s and floods ", o.flood_rates[0], "/s and ",
                o.flood_rates[1], "/s need floods of ", t, " s each, with ", o.quiet_between_s,
                " s between them in ", o.duration_s, " s");
  return t;
}

std::vector<trace_period> paper_bursty_periods(const paper_bursty_options& o) {
  const double flood = paper_flood_length_s(o);
  const double edge = (o.duration_s - 2 * flood - o.quiet_between_s) / 2;
  std::vector<trace_period> p;
  p.reserve(5);  // at most five periods (and no reallocation, which GCC 12 -O3 misreads)
  double t = 0;
  auto add = [&](double len, double rate, bool is_flood) {
    if (len > 0) p.push_back({t, t + len, rate, is_flood});
    t += len;
  };
  add(edge, o.quiet_rate, false);
  add(flood, o.flood_rates[0], true);
  add(o.quiet_between_s, o.quiet_rate, false);
  add(flood, o.flood_rates[1], true);
  add(o.duration_s - t, o.quiet_rate, false);  // the tail: what is left (edge, up to rounding)
  return p;
}

double paper_rollout_sigma(const paper_rollout_options& o) {
  validate(o);
  return std::log(static_cast<double>(o.output_cap) / o.output_median) /
         normal_quantile(1 - o.cut_share);
}

std::vector<request> paper_bursty_trace(uint64_t seed, const paper_bursty_options& o) {
  return chat_requests(seed, paper_bursty_periods(o), lengths_of(o));
}

void validate(const paper_steady_options& o) {
  MOEBIUS_CHECK(std::isfinite(o.duration_s) && o.duration_s > 0, errc::invalid_argument,
                "paper_steady_options: duration_s must be finite and > 0 (got ", o.duration_s, ")");
  MOEBIUS_CHECK(std::isfinite(o.rate) && o.rate > 0, errc::invalid_argument,
                "paper_steady_options: rate must be finite and > 0 (got ", o.rate, ")");
  validate(lengths_of(o), "paper_steady_options");
}

std::vector<request> paper_steady_trace(uint64_t seed, const paper_steady_options& o) {
  validate(o);
  return chat_requests(seed, {trace_period{0, o.duration_s, o.rate, false}}, lengths_of(o));
}

void validate(const paper_production_options& o) {
  const auto check = [](const char* field, double v, bool positive) {
    MOEBIUS_CHECK(std::isfinite(v) && (positive ? v > 0 : v >= 0), errc::invalid_argument,
                  "paper_production_options: ", field, " must be finite and ",
                  positive ? "> 0" : ">= 0", " (got ", v, ")");
  };
  check("duration_s", o.duration_s, true);
  check("mean_rate", o.mean_rate, true);
  check("rate_sigma", o.rate_sigma, false);
  check("rate_period_s", o.rate_period_s, true);
  check("prompt_sigma", o.prompt_sigma, false);
  check("output_sigma", o.output_sigma, false);
  MOEBIUS_CHECK(std::isfinite(o.prompt_median) && o.prompt_median >= 1, errc::invalid_argument,
                "paper_production_options: prompt_median must be >= 1 (got ", o.prompt_median, ")");
  MOEBIUS_CHECK(std::isfinite(o.output_median) && o.output_median >= 1, errc::invalid_argument,
                "paper_production_options: output_median must be >= 1 (got ", o.output_median, ")");
  MOEBIUS_CHECK(o.prompt_max >= 1 && o.output_max >= 1 && o.vocab >= 1, errc::invalid_argument,
                "paper_production_options: prompt_max, output_max and vocab must be >= 1 (got ",
                o.prompt_max, ", ", o.output_max, ", ", o.vocab, ")");
}

double paper_production_output_mean(const paper_production_options& o) {
  validate(o);
  const double cap = static_cast<double>(o.output_max), s = o.output_sigma;
  const double mu = std::log(o.output_median), lc = std::log(cap);
  if (s == 0) return std::min(o.output_median, cap);
  // E[min(X, c)] for ln X ~ N(mu, s^2): the part under c plus c times the share over it.
  return std::exp(mu + s * s / 2) * normal_cdf((lc - mu - s * s) / s) +
         cap * (1 - normal_cdf((lc - mu) / s));
}

std::vector<request> paper_production_trace(uint64_t seed, const paper_production_options& o) {
  validate(o);
  production_options p;
  p.duration_s = o.duration_s;
  p.mean_rate = o.mean_rate;
  p.rate_sigma = o.rate_sigma;
  p.rate_period_s = o.rate_period_s;
  p.prompt_median = o.prompt_median;
  p.prompt_sigma = o.prompt_sigma;
  p.output_median = o.output_median;
  p.output_sigma = o.output_sigma;
  p.prompt_scale = 1;  // every prompt token is a token of the run
  p.prompt_max = o.prompt_max;
  p.output_max = o.output_max;
  p.vocab = o.vocab;
  return production_trace(seed, p);
}

std::vector<request> paper_rollout_trace(uint64_t seed, const paper_rollout_options& o) {
  const double sigma = paper_rollout_sigma(o);
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> output(std::log(o.output_median), sigma);
  std::uniform_int_distribution<int64_t> prompt_len(o.prompt_min, o.prompt_max);
  std::vector<request> out;
  out.reserve(static_cast<size_t>(o.steps * o.prompts_per_step));
  for (int64_t step = 0; step < o.steps; ++step) {
    for (int64_t i = 0; i < o.prompts_per_step; ++i) {
      request r;
      r.id = static_cast<int64_t>(out.size());
      r.arrival_s = 0;
      r.rollout_step = step;
      const int64_t prompt = prompt_len(rng);
      const double len = std::round(output(rng));
      r.output_tokens =
          static_cast<int64_t>(std::clamp(len, 1.0, static_cast<double>(o.output_cap)));
      r.max_new_tokens = o.output_cap;  // the recipe's response cap is what its client asks for
      r.prompt = draw_prompt(seed, r.id, prompt, o.vocab);
      out.push_back(std::move(r));
    }
  }
  return out;
}

}  // namespace mini_engine
