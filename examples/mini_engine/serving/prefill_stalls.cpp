#include "prefill_stalls.hpp"

#include <algorithm>
#include <cmath>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;

void prefill_stalls::add(double step_ms, int64_t decode_tokens, int64_t decodes_held) {
  MOEBIUS_CHECK(std::isfinite(step_ms) && step_ms >= 0 && decode_tokens >= 0 && decodes_held >= 0,
                errc::invalid_argument, "prefill_stalls: step_ms (", step_ms,
                ") must be finite and >= 0, decode_tokens (", decode_tokens, ") and decodes_held (",
                decodes_held, ") >= 0");
  const int64_t slots = decode_tokens + decodes_held;
  time_.add(step_ms);
  lost_.add(slots > 0 ? step_ms * static_cast<double>(decodes_held) / static_cast<double>(slots)
                      : 0.0);
  decoded_.add(static_cast<double>(decode_tokens));
  held_.add(static_cast<double>(decodes_held));
}

double prefill_stalls::held_share() const {
  const double slots = decoded_.value() + held_.value();
  return slots > 0 ? held_.value() / slots : 0.0;
}

double prefill_stalls::lost_share() const {
  // Every slot held: lost and time are the same means, their ratio 1 up to rounding.
  return time_.value() > 0 ? std::clamp(lost_.value() / time_.value(), 0.0, 1.0) : 0.0;
}

double stall_factor(double lost_share) {
  MOEBIUS_CHECK(lost_share >= 0 && lost_share <= 1, errc::invalid_argument,
                "stall_factor: lost_share (", lost_share, ") must be in [0, 1]");
  return 1.0 / (1.0 - std::min(lost_share, k_max_lost_share));
}

double unseen_lost_share(double seen_held_share, double seen_lost_share, int64_t seen_groups,
                         int64_t unseen_groups) {
  MOEBIUS_CHECK(seen_held_share >= 0 && seen_held_share <= 1 && seen_lost_share >= 0 &&
                    seen_lost_share <= 1 && seen_groups >= 1 && unseen_groups >= 1,
                errc::invalid_argument, "unseen_lost_share: shares (", seen_held_share, ", ",
                seen_lost_share, ") must be in [0, 1] and group counts (", seen_groups, ", ",
                unseen_groups, ") >= 1");
  // Equal groups, nothing held, or every slot held (no finite a_s; the unseen groups then
  // hold every slot too): the seen share.
  if (seen_groups == unseen_groups || seen_held_share <= 0 || seen_held_share >= 1)
    return seen_lost_share;
  const double q_s = seen_held_share;
  const double a_u =
      -std::log1p(-q_s) * static_cast<double>(seen_groups) / static_cast<double>(unseen_groups);
  const double q_u = -std::expm1(-a_u);
  return std::min(1.0, seen_lost_share * q_u / q_s);
}

double ep_prefill_slowdown(const moebius::latency_curve& ep, double b, double pf, int64_t ranks,
                           int64_t rank_chunk) {
  MOEBIUS_CHECK(b >= 1 && std::isfinite(b) && pf >= 0 && std::isfinite(pf), errc::invalid_argument,
                "ep_prefill_slowdown: need b >= 1 and pf >= 0, finite (got b=", b, ", pf=", pf,
                ")");
  MOEBIUS_CHECK(ranks >= 1 && rank_chunk >= 1, errc::invalid_argument,
                "ep_prefill_slowdown: need ranks >= 1 and rank_chunk >= 1 (got ranks=", ranks,
                ", rank_chunk=", rank_chunk, ")");
  // The rows never spread thinner than evenly over the ranks (a chunk smaller than pf / ranks).
  const double busiest =
      std::max(pf / static_cast<double>(ranks), std::min(pf, static_cast<double>(rank_chunk)));
  return ep.at(b + static_cast<double>(ranks) * busiest) / ep.at(b + pf);
}

}  // namespace mini_engine
