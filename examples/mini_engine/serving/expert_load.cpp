#include "expert_load.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;

namespace {

void check_counts(int64_t tokens, int64_t experts, int ranks, int64_t top_k) {
  MOEBIUS_CHECK(tokens >= 0 && experts >= 1 && ranks >= 1 && top_k >= 1 && top_k <= experts &&
                    experts % ranks == 0,
                errc::invalid_argument, "expert load: tokens ", tokens, ", experts ", experts,
                ", ranks ", ranks, ", top_k ", top_k,
                " (tokens >= 0, 1 <= top_k <= experts, experts a multiple of ranks)");
}

// One step: each token draws top_k distinct experts in proportion to `weight` (the cumulative
// weights in `cdf`), the busiest rank's distinct experts returned.
int64_t sample_busiest(int64_t tokens, int64_t top_k, int64_t per_rank, const std::vector<double>& cdf,
                       std::mt19937_64& rng, std::vector<char>& touched, std::vector<int64_t>& on_rank) {
  std::fill(touched.begin(), touched.end(), 0);
  std::fill(on_rank.begin(), on_rank.end(), 0);
  std::uniform_real_distribution<double> u(0.0, cdf.back());
  std::vector<int64_t> picked;
  picked.reserve(static_cast<size_t>(top_k));
  for (int64_t t = 0; t < tokens; ++t) {
    picked.clear();
    while (static_cast<int64_t>(picked.size()) < top_k) {
      const auto e = static_cast<int64_t>(std::upper_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin());
      const int64_t expert = std::min<int64_t>(e, static_cast<int64_t>(cdf.size()) - 1);
      if (std::find(picked.begin(), picked.end(), expert) != picked.end()) continue;
      picked.push_back(expert);
      if (!touched[static_cast<size_t>(expert)]) {
        touched[static_cast<size_t>(expert)] = 1;
        ++on_rank[static_cast<size_t>(expert / per_rank)];
      }
    }
  }
  return *std::max_element(on_rank.begin(), on_rank.end());
}

}  // namespace

double mean_rank_experts(int64_t tokens, int64_t experts, int ranks, int64_t top_k) {
  check_counts(tokens, experts, ranks, top_k);
  const double E = static_cast<double>(experts);
  return E / ranks * (1 - std::pow(1 - static_cast<double>(top_k) / E, static_cast<double>(tokens)));
}

double busiest_rank_experts(int64_t tokens, int64_t experts, int ranks, int64_t top_k,
                            const routing_model& routing, int samples) {
  check_counts(tokens, experts, ranks, top_k);
  MOEBIUS_CHECK(std::isfinite(routing.skew) && routing.skew >= 0 && samples >= 1,
                errc::invalid_argument, "expert load: skew ", routing.skew, ", samples ", samples,
                " (skew finite and >= 0, samples >= 1)");
  const int64_t per_rank = experts / ranks;
  if (tokens == 0) return 0;
  // Uniform routing with every expert almost surely read: each rank reads all of its own.
  if (routing.skew == 0 &&
      static_cast<double>(experts) * std::pow(1 - static_cast<double>(top_k) / static_cast<double>(experts),
                                               static_cast<double>(tokens)) < 1e-6)
    return static_cast<double>(per_rank);
  using key_t = std::tuple<int64_t, int64_t, int, int64_t, double, int>;
  static std::mutex mutex;
  static std::map<key_t, double> memo;
  const key_t key{tokens, experts, ranks, top_k, routing.skew, samples};
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = memo.find(key); it != memo.end()) return it->second;
  }
  std::mt19937_64 rng(0x6d6f65626975735ull);  // fixed: every run prices alike
  // Popularity: (position in a fixed random order)^-skew; uniform at skew 0.
  std::vector<int64_t> order(static_cast<size_t>(experts));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<double> weight(static_cast<size_t>(experts));
  for (int64_t i = 0; i < experts; ++i)
    weight[static_cast<size_t>(order[static_cast<size_t>(i)])] = std::pow(static_cast<double>(i + 1), -routing.skew);
  std::vector<double> cdf(weight.size());
  std::partial_sum(weight.begin(), weight.end(), cdf.begin());
  std::vector<char> touched(static_cast<size_t>(experts));
  std::vector<int64_t> on_rank(static_cast<size_t>(ranks));
  double total = 0;
  for (int s = 0; s < samples; ++s)
    total += static_cast<double>(sample_busiest(tokens, top_k, per_rank, cdf, rng, touched, on_rank));
  const double busiest = total / samples;
  std::lock_guard<std::mutex> lock(mutex);
  memo.emplace(key, busiest);
  return busiest;
}

double emulated_rank_experts(bool tp_attention, int64_t batch, int64_t experts, int ranks,
                             int64_t top_k) {
  check_counts(batch, experts, ranks, top_k);
  const int64_t per_rank = experts / ranks;
  const double E = static_cast<double>(per_rank);
  int64_t k = 0, tokens = 0;
  if (tp_attention) {
    k = std::min<int64_t>(per_rank, std::max<int64_t>(1, std::llround(static_cast<double>(top_k) / ranks)));
    tokens = batch;
  } else {
    k = std::min<int64_t>(per_rank, top_k);
    tokens = (batch + ranks - 1) / ranks;
  }
  return E * (1 - std::pow(1 - static_cast<double>(k) / E, static_cast<double>(tokens)));
}

double expert_load_shift_ms(bool tp_attention, int64_t batch, int64_t experts, int ranks,
                            int64_t top_k, int64_t layers, double expert_bytes,
                            double hbm_bytes_per_s, const routing_model& routing) {
  MOEBIUS_CHECK(layers >= 0 && expert_bytes >= 0 && hbm_bytes_per_s > 0, errc::invalid_argument,
                "expert load: layers ", layers, ", expert_bytes ", expert_bytes, ", hbm ",
                hbm_bytes_per_s, " B/s (layers, bytes >= 0, hbm > 0)");
  const double extra = busiest_rank_experts(batch, experts, ranks, top_k, routing) -
                       emulated_rank_experts(tp_attention, batch, experts, ranks, top_k);
  return extra * static_cast<double>(layers) * expert_bytes / hbm_bytes_per_s * 1e3;
}

}  // namespace mini_engine
