#include "step_collectives.hpp"

#include <cmath>

#include <moebius/error.hpp>

#include "collective_table.hpp"

namespace mini_engine {

using moebius::errc;

std::string_view name_of(collective_pricing p) {
  switch (p) {
    case collective_pricing::link: return "link";
    case collective_pricing::cited: return "cited";
  }
  return "unknown";
}

namespace {

void validate(const decode_step_shape& s) {
  MOEBIUS_CHECK(s.batch >= 0 && s.rank_pairs >= 0 && s.num_ranks >= 1 && s.dcp >= 1 &&
                    s.layers >= 0 && s.hidden >= 1,
                errc::invalid_argument, "decode step collectives: batch ", s.batch,
                ", rank_pairs ", s.rank_pairs, ", num_ranks ", s.num_ranks, ", dcp ", s.dcp,
                ", layers ", s.layers, ", hidden ", s.hidden,
                " (batch, pairs, layers >= 0; the others >= 1)");
  MOEBIUS_CHECK(s.dcp == 1 || (s.tp_attention && s.q_heads >= s.num_ranks && s.head_dim >= 1),
                errc::invalid_argument, "decode step collectives: dcp ", s.dcp,
                " needs TP attention and the model's q heads (", s.q_heads, ", at least P = ",
                s.num_ranks, ") and head dim (", s.head_dim, ")");
}

}  // namespace

double dcp_exchange_layer_s(const decode_step_shape& s, collective_pricing pricing,
                            const link_model& link) {
  validate(s);
  if (!s.tp_attention || s.dcp == 1) return 0;
  const double d = static_cast<double>(s.dcp), B = static_cast<double>(s.batch);
  const double hq = static_cast<double>(s.q_heads / s.num_ranks);
  const double D = static_cast<double>(s.head_dim);
  // Per member: its q heads, its log-sum-exps of the set's d x hq heads, its partial outputs
  // of them.
  const double q = B * hq * D * 2, lse = B * d * hq * 4, out = B * d * hq * D * 2;
  if (pricing == collective_pricing::link) {
    // Each member receives (d-1)/d of what is gathered, or of the outputs it keeps: the other
    // members' q, their log-sum-exps, their partials of its hq heads.
    const double received = (d - 1) * q + (d - 1) * lse + (d - 1) * out / d;
    return (1 + link.dcp_merge_collectives) * link.latency_s +
           received / link.allreduce_bytes_per_s;
  }
  const int n = static_cast<int>(s.dcp);
  return collective_s(collective_kind::dcp_all_gather, d * q, n) +
         collective_s(collective_kind::dcp_all_gather, d * lse, n) +
         collective_s(collective_kind::dcp_reduce_scatter, out, n);
}

double decode_step_collectives_s(const decode_step_shape& s, collective_pricing pricing,
                                 const link_model& link) {
  validate(s);
  if (s.num_ranks == 1) return 0;
  const double P = s.num_ranks, L = static_cast<double>(s.layers);
  const double H = static_cast<double>(s.hidden);
  if (s.tp_attention) {
    const double bytes = static_cast<double>(s.batch) * H * 2;  // each rank's buffer
    const double dcp = dcp_exchange_layer_s(s, pricing, link);
    if (pricing == collective_pricing::link) {
      // A ring all-reduce sends 2 (P-1)/P of the buffer.
      const double all_reduce = link.latency_s + 2 * (P - 1) / P * bytes / link.allreduce_bytes_per_s;
      return L * (2 * all_reduce + dcp) + link.latency_s;
    }
    return L * (2 * collective_s(collective_kind::tp_all_reduce, bytes, s.num_ranks) + dcp) +
           collective_s(collective_kind::tp_all_reduce, 0, s.num_ranks);
  }
  const double rows = static_cast<double>(s.rank_pairs), bytes = rows * H * 2;
  if (pricing == collective_pricing::link)
    return L * 2 * (link.latency_s + (P - 1) / P * bytes / link.all_to_all_bytes_per_s);
  return L * (collective_s(collective_kind::ep_dispatch, bytes, s.num_ranks) +
              collective_s(collective_kind::ep_combine, bytes, s.num_ranks));
}

double collectives_shift_ms(const decode_step_shape& s, collective_pricing from,
                            collective_pricing to) {
  if (from == to) return 0;
  return (decode_step_collectives_s(s, to) - decode_step_collectives_s(s, from)) * 1e3;
}

}  // namespace mini_engine
