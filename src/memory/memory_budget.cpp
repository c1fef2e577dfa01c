#include "moebius/memory/memory_budget.hpp"

#include <algorithm>
#include <iomanip>
#include <ostream>
#include <vector>

#include "moebius/detail/checked_math.hpp"
#include "moebius/error.hpp"

namespace moebius {

namespace {

using detail::checked_add;
using detail::checked_mul;
using detail::checked_product;

void validate(const attention_shape& a) {
  MOEBIUS_CHECK(a.num_layers > 0 && a.hidden > 0 && a.num_q_heads > 0 && a.num_kv_heads > 0 &&
                    a.head_dim > 0,
                errc::invalid_argument,
                "attention sizes must be > 0 (layers=", a.num_layers, ", hidden=", a.hidden,
                ", q_heads=", a.num_q_heads, ", kv_heads=", a.num_kv_heads,
                ", head_dim=", a.head_dim, ")");
  MOEBIUS_CHECK(a.num_q_heads % a.num_kv_heads == 0, errc::invalid_argument,
                "kv heads must divide q heads (q_heads=", a.num_q_heads,
                ", kv_heads=", a.num_kv_heads, ")");
}

int64_t norm_bytes(const attention_shape& a) {
  return a.qk_norm ? checked_product("q/k norm bytes", 2, a.head_dim, dtype_bytes(a.weight_dtype))
                   : 0;
}

// Bytes of q (or o) and of k (or v) of one layer, whole.
int64_t q_bytes(const attention_shape& a) {
  return checked_product("q projection bytes", a.hidden, a.num_q_heads, a.head_dim,
                         dtype_bytes(a.weight_dtype));
}
int64_t kv_bytes(const attention_shape& a) {
  return checked_product("k projection bytes", a.hidden, a.num_kv_heads, a.head_dim,
                         dtype_bytes(a.weight_dtype));
}

}  // namespace

int64_t attention_bytes_whole(const attention_shape& a) {
  validate(a);
  int64_t layer = checked_add(checked_mul(q_bytes(a), 2, "q+o bytes"),
                              checked_mul(kv_bytes(a), 2, "k+v bytes"), "attention layer bytes");
  layer = checked_add(layer, norm_bytes(a), "attention layer bytes");
  return checked_mul(layer, a.num_layers, "attention bytes");
}

int64_t attention_bytes_tp_rank(const attention_shape& a, int num_ranks) {
  validate(a);
  MOEBIUS_CHECK(num_ranks >= 1 && a.num_q_heads % num_ranks == 0, errc::invalid_argument,
                "TP needs P to divide the q heads (q_heads=", a.num_q_heads, ", P=", num_ranks,
                ")");
  MOEBIUS_CHECK(a.num_kv_heads % num_ranks == 0 || num_ranks % a.num_kv_heads == 0,
                errc::invalid_argument,
                "TP needs P to divide the kv heads or the kv heads to divide P (kv_heads=",
                a.num_kv_heads, ", P=", num_ranks, ")");
  // H_kv < P: one head per rank, each head replicated P/H_kv times (DESIGN.md §4).
  const int64_t kv_heads_per_rank = std::max<int64_t>(1, a.num_kv_heads / num_ranks);
  const int64_t kv_per_rank = kv_bytes(a) / a.num_kv_heads * kv_heads_per_rank;
  int64_t layer = checked_add(checked_mul(q_bytes(a) / num_ranks, 2, "q+o bytes"),
                              checked_mul(kv_per_rank, 2, "k+v bytes"), "attention layer bytes");
  layer = checked_add(layer, norm_bytes(a), "attention layer bytes");
  return checked_mul(layer, a.num_layers, "attention bytes");
}

int64_t dense_bytes(const dense_shape& d, const attention_shape& a) {
  validate(a);
  MOEBIUS_CHECK(d.vocab >= 0 && d.num_experts >= 0 && d.norms_per_layer >= 0,
                errc::invalid_argument, "dense sizes must be >= 0 (vocab=", d.vocab,
                ", experts=", d.num_experts, ", norms_per_layer=", d.norms_per_layer, ")");
  if (d.vocab == 0) return 0;
  const int64_t eb = dtype_bytes(d.weight_dtype);
  const int64_t embed = checked_product("embedding bytes", d.vocab, a.hidden, eb);
  int64_t sum = d.tied_embeddings ? embed : checked_mul(embed, 2, "embedding + lm_head bytes");
  const int64_t per_layer =
      checked_add(checked_product("router bytes", d.num_experts, a.hidden, eb),
                  checked_product("norm bytes", d.norms_per_layer, a.hidden, eb), "dense bytes");
  sum = checked_add(sum, checked_mul(per_layer, a.num_layers, "dense bytes"), "dense bytes");
  return checked_add(sum, checked_mul(a.hidden, eb, "final norm bytes"), "dense bytes");
}

int64_t max_ops_per_rank(const plan& p) {
  MOEBIUS_CHECK(p.num_ranks >= 1, errc::invalid_argument,
                "plan needs num_ranks >= 1 (num_ranks=", p.num_ranks, ")");
  std::vector<int64_t> ops(static_cast<size_t>(p.num_ranks), 0);
  for (const plan_phase& phase : p.phases) {
    for (const copy_op& op : phase.ops) {
      MOEBIUS_CHECK(op.src_rank >= 0 && op.src_rank < p.num_ranks, errc::invalid_argument,
                    "plan op source rank out of range (src_rank=", op.src_rank,
                    ", P=", p.num_ranks, ")");
      ++ops[static_cast<size_t>(op.src_rank)];
    }
  }
  return *std::max_element(ops.begin(), ops.end());
}

memory_budget make_memory_budget(const arena_geometry& g, const attention_shape& attention,
                                 const dense_shape& dense, int64_t kv_pool_bytes,
                                 const switch_footprint& f) {
  validate(g);  // the geometry's fields are public: it may have been edited since it was built
  MOEBIUS_CHECK(g.num_ranks >= 1 && g.shape.num_layers >= 1, errc::invalid_argument,
                "geometry needs num_ranks >= 1 and L >= 1 (num_ranks=", g.num_ranks,
                ", L=", g.shape.num_layers, ")");
  MOEBIUS_CHECK(g.slot_bytes >= g.layer_bytes_per_rank(), errc::invalid_argument,
                "a slot must hold one layer's expert bytes (slot_bytes=", g.slot_bytes,
                ", layer bytes=", g.layer_bytes_per_rank(), ")");
  MOEBIUS_CHECK(attention.num_layers == g.shape.num_layers, errc::invalid_argument,
                "attention and experts must have the same number of layers (attention=",
                attention.num_layers, ", experts L=", g.shape.num_layers, ")");
  MOEBIUS_CHECK(kv_pool_bytes >= 0 && f.descriptor_ops_per_rank >= 0 &&
                    f.barrier_flag_slots >= 0 && f.flag_bytes >= 0 && f.scratch_bytes >= 0,
                errc::invalid_argument,
                "budget inputs must be >= 0 (kv_pool_bytes=", kv_pool_bytes,
                ", descriptor_ops=", f.descriptor_ops_per_rank,
                ", flag_slots=", f.barrier_flag_slots, ", flag_bytes=", f.flag_bytes,
                ", scratch_bytes=", f.scratch_bytes, ")");

  memory_budget b;
  b.num_ranks = g.num_ranks;
  b.num_layers = g.shape.num_layers;
  b.expert_bytes = checked_mul(g.layer_bytes_per_rank(), g.shape.num_layers, "expert bytes");
  b.arena_bytes = checked_mul(g.slot_bytes, g.num_slots(), "arena bytes");
  b.spare_slot_bytes = g.slot_bytes;
  b.padding_bytes = checked_mul(g.slot_bytes - g.layer_bytes_per_rank(), g.shape.num_layers,
                                "padding bytes");
  b.attention_bytes = attention_bytes_whole(attention);
  b.attention_tp_view_bytes = 0;
  b.static_tp_attention_bytes = attention_bytes_tp_rank(attention, g.num_ranks);
  b.dense_bytes = dense_bytes(dense, attention);
  b.kv_pool_bytes = kv_pool_bytes;
  b.descriptor_bytes = checked_mul(f.descriptor_ops_per_rank,
                                   static_cast<int64_t>(sizeof(copy_op)), "descriptor bytes");
  b.flag_bytes = checked_mul(f.barrier_flag_slots, f.flag_bytes, "flag bytes");
  b.scratch_bytes = f.scratch_bytes;
  b.total_bytes();  // checks the sum fits
  return b;
}

int64_t memory_budget::switching_overhead_bytes() const {
  int64_t s = checked_add(spare_slot_bytes, padding_bytes, "overhead bytes");
  s = checked_add(s, descriptor_bytes, "overhead bytes");
  s = checked_add(s, flag_bytes, "overhead bytes");
  return checked_add(s, scratch_bytes, "overhead bytes");
}

int64_t memory_budget::static_ep_total_bytes() const {
  int64_t s = checked_add(expert_bytes, attention_bytes, "static EP bytes");
  s = checked_add(s, dense_bytes, "static EP bytes");
  return checked_add(s, kv_pool_bytes, "static EP bytes");
}

int64_t memory_budget::static_tp_total_bytes() const {
  int64_t s = checked_add(expert_bytes, static_tp_attention_bytes, "static TP bytes");
  s = checked_add(s, dense_bytes, "static TP bytes");
  return checked_add(s, kv_pool_bytes, "static TP bytes");
}

int64_t memory_budget::total_bytes() const {
  return checked_add(static_ep_total_bytes(), switching_overhead_bytes(), "total bytes");
}

double memory_budget::spare_fraction_of_arena() const {
  return arena_bytes == 0 ? 0.0
                          : static_cast<double>(spare_slot_bytes) / static_cast<double>(arena_bytes);
}

double memory_budget::overhead_fraction_of_experts() const {
  return expert_bytes == 0 ? 0.0
                           : static_cast<double>(switching_overhead_bytes()) /
                                 static_cast<double>(expert_bytes);
}

double memory_budget::overhead_fraction_vs_static_ep() const {
  const double base = static_cast<double>(static_ep_total_bytes());
  return (static_cast<double>(total_bytes()) - base) / base;
}

double memory_budget::overhead_fraction_vs_static_tp() const {
  const double base = static_cast<double>(static_tp_total_bytes());
  return (static_cast<double>(total_bytes()) - base) / base;
}

std::ostream& operator<<(std::ostream& os, const memory_budget& b) {
  const auto flags = os.flags();
  const auto precision = os.precision();
  auto row = [&](const char* name, int64_t bytes) {
    os << "  " << std::left << std::setw(28) << name << std::right << std::setw(16) << bytes
       << " B " << std::setw(10) << std::fixed << std::setprecision(3)
       << static_cast<double>(bytes) / static_cast<double>(int64_t{1} << 30) << " GiB\n";
  };
  os << "memory budget per rank (P=" << b.num_ranks << ", L=" << b.num_layers << ")\n";
  row("expert weights", b.expert_bytes);
  row("arena spare slot", b.spare_slot_bytes);
  row("arena padding", b.padding_bytes);
  row("attention weights (whole)", b.attention_bytes);
  row("attention TP views (extra)", b.attention_tp_view_bytes);
  row("other dense weights", b.dense_bytes);
  row("KV pool", b.kv_pool_bytes);
  row("plan descriptors", b.descriptor_bytes);
  row("barrier flags", b.flag_bytes);
  row("switch scratch", b.scratch_bytes);
  row("total", b.total_bytes());
  row("switching overhead", b.switching_overhead_bytes());
  row("static EP rank total", b.static_ep_total_bytes());
  row("static TP rank total", b.static_tp_total_bytes());
  os << std::setprecision(3) << "  spare slot = " << b.spare_fraction_of_arena() * 100.0
     << "% of the arena; switching overhead = " << b.overhead_fraction_of_experts() * 100.0
     << "% of expert bytes\n  vs static EP: +" << b.overhead_fraction_vs_static_ep() * 100.0
     << "%; vs static TP: +" << b.overhead_fraction_vs_static_tp() * 100.0
     << "% (attention held whole: +"
     << static_cast<double>(b.attention_bytes - b.static_tp_attention_bytes) /
            static_cast<double>(int64_t{1} << 30)
     << " GiB)\n";
  os.flags(flags);
  os.precision(precision);
  return os;
}

}  // namespace moebius
