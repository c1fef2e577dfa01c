#include "host_runtime.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>
#include <moebius/layout/weight_view.hpp>

#include "kv_pages.hpp"
#include "numerics.hpp"

namespace mini_engine {

using moebius::dtype;
using moebius::errc;
using moebius::kv_tensor;
using moebius::parallel_mode;
using moebius::weight_tensor;

namespace {

// Eight partial sums in double, combined in a fixed order: the same code (and so the same
// rounding) wherever a row is computed. Products of two floats are exact in double, so a
// fused multiply-add, where the compiler contracts one, rounds exactly as the plain sum.
template <class W, class X>
inline double dot(const W* __restrict w, const X* __restrict x, int64_t n) {
  double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j)
      a[j] += static_cast<double>(w[i + j]) * static_cast<double>(x[i + j]);
  double s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  for (; i < n; ++i) s += static_cast<double>(w[i]) * static_cast<double>(x[i]);
  return s;
}

// out = in / sqrt(mean(in^2) + eps) * w, rounded to float (and held as Out: activations
// that feed many dot products are kept as double, exactly the float they were rounded to,
// so that the loops convert only the weights).
template <class Out>
inline void rmsnorm(const float* in, const float* w, int64_t n, double eps, Out* out) {
  const double inv = 1.0 / std::sqrt(dot(in, in, n) / static_cast<double>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<float>(static_cast<double>(in[i]) * inv * static_cast<double>(w[i]));
}

std::vector<double> to_double(const std::vector<float>& v) {
  return {v.begin(), v.end()};
}

// rotate_half RoPE of x[0, D) with the position's cos/sin [D/2].
inline void rope(float* x, const double* cs, const double* sn, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double x1 = x[i], x2 = x[i + half];
    x[i] = static_cast<float>(x1 * cs[i] - x2 * sn[i]);
    x[i + half] = static_cast<float>(x2 * cs[i] + x1 * sn[i]);
  }
}

const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i)
      t[static_cast<size_t>(i)] = from_fp8_e4m3(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}

// Decodes n elements of an expert row into double. fp8: code * scale[j / block] (exact in
// double: a 4-bit significand times a power of two).
void dequant_row(const std::byte* p, dtype t, const std::byte* scales, int64_t block, int64_t n,
                 double* out) {
  switch (t) {
    case dtype::fp32:
      for (int64_t j = 0; j < n; ++j) {
        float v;
        std::memcpy(&v, p + 4 * j, 4);
        out[j] = v;
      }
      break;
    case dtype::bf16:
      for (int64_t j = 0; j < n; ++j) {
        uint16_t v;
        std::memcpy(&v, p + 2 * j, 2);
        out[j] = from_bf16(v);
      }
      break;
    default: {
      const auto& table = fp8_table();
      for (int64_t b0 = 0; b0 < n; b0 += block) {
        float s;
        std::memcpy(&s, scales + 4 * (b0 / block), 4);
        const double scale = s;
        for (int64_t j = b0; j < b0 + block; ++j)
          out[j] = static_cast<double>(table[static_cast<uint8_t>(p[j])]) * scale;
      }
    }
  }
}

// fp32 expert rows are read in place: the arena is new[]-allocated (max-aligned) and every
// tensor offset is a multiple of 4 bytes (its alignment and element size).
inline const float* as_floats(const std::byte* p) {
  return reinterpret_cast<const float*>(p);
}

void store_kv(std::byte* p, const float* v, int64_t n, dtype t) {
  if (t == dtype::fp32) {
    std::memcpy(p, v, static_cast<size_t>(4 * n));
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t u = to_bf16(v[j]);
    std::memcpy(p + 2 * j, &u, 2);
  }
}

void load_kv(const std::byte* p, double* v, int64_t n, dtype t) {
  if (t == dtype::fp32) {
    for (int64_t j = 0; j < n; ++j) {
      float f;
      std::memcpy(&f, p + 4 * j, 4);
      v[j] = f;
    }
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    uint16_t u;
    std::memcpy(&u, p + 2 * j, 2);
    v[j] = from_bf16(u);
  }
}

template <class T>
void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
}

}  // namespace

void host_runtime::lay_out(const host_runtime_options& options) {
  const model_config& c = weights_.config;
  validate(c, options.num_ranks);
  MOEBIUS_CHECK(options.num_ep_pages >= 1, errc::invalid_argument,
                "host_runtime: num_ep_pages must be >= 1 (got ", options.num_ep_pages, ")");
  arena_geometry_ = moebius::make_arena_geometry(expert_shape_of(c), options.num_ranks,
                                                 options.tensor_alignment, options.slot_alignment);
  moebius::validate(arena_geometry_, options.cursor);
  kv_geometry_ = kv_geometry_of(c, options.num_ranks, options.num_ep_pages);
  arenas_.assign(static_cast<size_t>(options.num_ranks),
                 std::vector<std::byte>(static_cast<size_t>(arena_geometry_.total_bytes())));
  pools_.assign(static_cast<size_t>(options.num_ranks),
                std::vector<std::byte>(static_cast<size_t>(kv_geometry_.pool_bytes())));
  const int64_t D = c.head_dim;
  inv_freq_.resize(static_cast<size_t>(D / 2));
  for (int64_t i = 0; i < D / 2; ++i)
    inv_freq_[static_cast<size_t>(i)] =
        std::pow(c.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
}

host_runtime::host_runtime(const model_weights& weights, const host_runtime_options& options)
    : weights_(weights) {
  validate(weights_);
  lay_out(options);
  place_experts(weights, options.cursor);
  for (const auto& l : weights_.layers)
    dense_.push_back({to_double(l.q_proj), to_double(l.k_proj), to_double(l.v_proj),
                      to_double(l.o_proj), to_double(l.router)});
  lm_head_ = to_double(weights_.lm_head);
  for (auto& l : weights_.layers) {  // the arena holds them now
    l.w13 = {};
    l.w2 = {};
    l.w13_scale = {};
    l.w2_scale = {};
  }
}

host_runtime::host_runtime(const model_config& config, const host_runtime_options& options,
                           const std::function<void(weight_sink&)>& load) {
  weights_.config = config;
  lay_out(options);
  const model_config& c = weights_.config;
  const int64_t H = c.hidden, D = c.head_dim, L = c.num_layers;
  auto zeros = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n), 0.0f); };
  auto zerod = [](int64_t n) { return std::vector<double>(static_cast<size_t>(n), 0.0); };
  // What the runtime keeps beside the arena; the projections only as double (dense_).
  weights_.embed = zeros(c.vocab * H);
  weights_.norm = zeros(H);
  weights_.layers.resize(static_cast<size_t>(L));
  for (auto& l : weights_.layers) {
    l.input_layernorm = zeros(H);
    l.post_attention_layernorm = zeros(H);
    l.q_norm = zeros(D);
    l.k_norm = zeros(D);
  }
  for (int64_t i = 0; i < L; ++i)
    dense_.push_back({zerod(c.q_dim() * H), zerod(c.kv_dim() * H), zerod(c.kv_dim() * H),
                      zerod(H * c.q_dim()), zerod(c.num_experts * H)});
  lm_head_ = zerod(c.vocab * H);

  // Each tensor once into its place; a local class has the constructor's access.
  class sink final : public weight_sink {
   public:
    sink(host_runtime& rt, moebius::arena_cursor cursor) : rt_(rt), cursor_(cursor) {
      spans_.assign(rt.arenas_.begin(), rt.arenas_.end());
      const model_config& m = rt.weights_.config;
      seen_.assign(static_cast<size_t>(3 + m.num_layers * (9 + 3 * m.num_experts)), 0);
    }
    void put(hf_tensor t, int64_t layer, int64_t e, const tensor_source& src) override {
      const model_config& m = rt_.weights_.config;
      const bool global = t == hf_tensor::embed || t == hf_tensor::lm_head || t == hf_tensor::norm;
      MOEBIUS_CHECK(global || (layer >= 0 && layer < m.num_layers &&
                               (!is_expert(t) || (e >= 0 && e < m.num_experts))),
                    errc::invalid_argument, "host_runtime: tensor ", src.name, " of layer ",
                    layer, " expert ", e, " is outside the model");
      const int64_t idx = t == hf_tensor::embed     ? 0
                          : t == hf_tensor::lm_head ? 1
                          : t == hf_tensor::norm    ? 2
                          : is_expert(t) ? 3 + m.num_layers * 9 +
                                               (layer * m.num_experts + e) * 3 +
                                               (static_cast<int64_t>(t) - static_cast<int64_t>(hf_tensor::gate_proj))
                                         : 3 + layer * 9 + (static_cast<int64_t>(t) -
                                                            static_cast<int64_t>(hf_tensor::input_layernorm));
      MOEBIUS_CHECK(idx >= 0 && idx < static_cast<int64_t>(seen_.size()) &&
                        seen_[static_cast<size_t>(idx)] == 0,
                    errc::invalid_argument, "host_runtime: tensor ", src.name,
                    " delivered twice or outside the model");
      seen_[static_cast<size_t>(idx)] = 1;
      if (is_expert(t)) {
        place_expert_part(m, rt_.arena_geometry_, layer,
                          moebius::arena_geometry::mode_of(cursor_, layer), e, t, src, spans_);
        return;
      }
      const int64_t want = t == hf_tensor::embed || t == hf_tensor::lm_head ? m.vocab * m.hidden : -1;
      MOEBIUS_CHECK(want < 0 || src.numel() == want, errc::invalid_argument, "host_runtime: tensor ",
                    src.name, " has ", src.numel(), " elements, the model needs ", want);
      auto into_f = [&](std::vector<float>& v) {
        MOEBIUS_CHECK(src.numel() == static_cast<int64_t>(v.size()), errc::invalid_argument,
                      "host_runtime: tensor ", src.name, " has ", src.numel(),
                      " elements, the model needs ", v.size());
        src.read_all(v.data());
      };
      auto into_d = [&](std::vector<double>& v) {
        MOEBIUS_CHECK(src.numel() == static_cast<int64_t>(v.size()), errc::invalid_argument,
                      "host_runtime: tensor ", src.name, " has ", src.numel(),
                      " elements, the model needs ", v.size());
        src.read_all(v.data());
      };
      if (t == hf_tensor::embed) return into_f(rt_.weights_.embed);
      if (t == hf_tensor::lm_head) return into_d(rt_.lm_head_);
      if (t == hf_tensor::norm) return into_f(rt_.weights_.norm);
      layer_weights& l = rt_.weights_.layers[static_cast<size_t>(layer)];
      dense_layer& d = rt_.dense_[static_cast<size_t>(layer)];
      switch (t) {
        case hf_tensor::input_layernorm: return into_f(l.input_layernorm);
        case hf_tensor::post_attention_layernorm: return into_f(l.post_attention_layernorm);
        case hf_tensor::q_norm: return into_f(l.q_norm);
        case hf_tensor::k_norm: return into_f(l.k_norm);
        case hf_tensor::q_proj: return into_d(d.q_proj);
        case hf_tensor::k_proj: return into_d(d.k_proj);
        case hf_tensor::v_proj: return into_d(d.v_proj);
        case hf_tensor::o_proj: return into_d(d.o_proj);
        case hf_tensor::router: return into_d(d.router);
        default: return;
      }
    }
    int64_t missing() const {
      return static_cast<int64_t>(std::count(seen_.begin(), seen_.end(), 0));
    }

   private:
    host_runtime& rt_;
    moebius::arena_cursor cursor_;
    std::vector<std::span<std::byte>> spans_;
    std::vector<char> seen_;
  } s(*this, options.cursor);
  load(s);
  MOEBIUS_CHECK(s.missing() == 0, errc::invalid_argument, "host_runtime: the loader left ",
                s.missing(), " tensors of the model unwritten");
}

void host_runtime::place_experts(const model_weights& weights, moebius::arena_cursor cursor) {
  MOEBIUS_CHECK(weights.config.num_layers == config().num_layers &&
                    weights.config.hidden == config().hidden &&
                    weights.config.num_experts == config().num_experts &&
                    weights.config.intermediate == config().intermediate &&
                    weights.config.expert_dtype == config().expert_dtype,
                errc::invalid_argument, "host_runtime::place_experts: weights of another model");
  std::vector<std::span<std::byte>> spans(arenas_.begin(), arenas_.end());
  mini_engine::place_experts(weights, arena_geometry_, cursor, spans);
}

std::vector<moebius::rank_memory> host_runtime::memory() {
  std::vector<moebius::rank_memory> m;
  for (size_t r = 0; r < arenas_.size(); ++r)
    m.push_back(moebius::rank_memory::host(arenas_[r], pools_[r]));
  return m;
}

std::vector<int32_t> host_runtime::compute(const step_layout& layout,
                                           std::span<const step_item> items,
                                           std::vector<std::vector<float>>* logits) {
  const model_config& c = weights_.config;
  // The table sets the step reads: one (static) or both (hybrid, step.hpp).
  MOEBIUS_CHECK(layout.hybrid() || (layout.tables != nullptr && layout.tp_tables == nullptr &&
                                    layout.ep_tables == nullptr),
                errc::invalid_argument,
                "step: give either `tables` (static) or both tp_tables and ep_tables (hybrid)");
  std::array<const moebius::kv_state*, 2> sets{layout.tables, nullptr};
  if (layout.hybrid()) {
    MOEBIUS_CHECK(layout.tp_tables->mode == parallel_mode::tp &&
                      layout.ep_tables->mode == parallel_mode::ep,
                  errc::invalid_argument, "step: hybrid layout with tp_tables in ",
                  moebius::to_string(layout.tp_tables->mode), " and ep_tables in ",
                  moebius::to_string(layout.ep_tables->mode));
    sets = {layout.tp_tables, layout.ep_tables};
  }
  for (const moebius::kv_state* s : sets)
    if (s) moebius::validate(kv_geometry_, *s);
  moebius::validate(arena_geometry_, layout.cursor);
  const int64_t H = c.hidden, V = c.vocab, D = c.head_dim;

  // Flatten the items' new tokens into one batch.
  tokens_.clear();
  token_ids_.clear();
  for (size_t i = 0; i < items.size(); ++i) {
    const step_item& it = items[i];
    MOEBIUS_CHECK(!it.tokens.empty(), errc::invalid_argument, "step: item ", i, " (sequence ",
                  it.seq_id, ") has no tokens");
    MOEBIUS_CHECK(it.start_position >= 0, errc::invalid_argument, "step: sequence ", it.seq_id,
                  " starts at position ", it.start_position);
    for (size_t j = 0; j < it.tokens.size(); ++j) {
      MOEBIUS_CHECK(it.tokens[j] >= 0 && it.tokens[j] < V, errc::invalid_argument,
                    "step: sequence ", it.seq_id, " token ", it.tokens[j], " outside vocab ", V);
      tokens_.push_back({static_cast<int64_t>(i), it.start_position + static_cast<int64_t>(j)});
      token_ids_.push_back(it.tokens[j]);
    }
  }
  // Every item's sequence must be in the tables with room for its tokens (EP: on one owner,
  // TP: on every rank); checked before anything is written, so a refused step changes
  // nothing.
  for (const step_item& it : items) {
    const int64_t end = it.start_position + static_cast<int64_t>(it.tokens.size());
    for (const moebius::kv_state* s : sets) {
      if (!s) continue;
      int holders = 0;
      for (int r = 0; r < num_ranks(); ++r) {
        const moebius::kv_sequence* seq = find_sequence(*s, r, it.seq_id);
        if (!seq) continue;
        ++holders;
        MOEBIUS_CHECK(seq->num_tokens >= end, errc::invalid_argument, "step: sequence ",
                      it.seq_id, " holds ", seq->num_tokens, " tokens on ",
                      moebius::to_string(s->mode), " rank ", r,
                      ", the step writes up to position ", end - 1);
      }
      MOEBIUS_CHECK(holders >= 1, errc::invalid_argument, "step: sequence ", it.seq_id,
                    " is not in the ", moebius::to_string(s->mode), " tables");
    }
  }
  // A hybrid step whose mode changes between two layers hands the activations off
  // (layer_schedule.hpp); its layouts and maps are built here, before anything is written.
  token_layout ep_layout;
  hand_off_maps maps;
  bool changes = false;
  for (int64_t l = 1; l < c.num_layers; ++l)
    changes = changes || layout.attention_mode(l) != layout.attention_mode(l - 1);
  if (layout.hybrid() && changes) {
    const token_layout tp_layout = token_layout_of(*layout.tp_tables, num_ranks(), items);
    ep_layout = token_layout_of(*layout.ep_tables, num_ranks(), items);
    maps = hand_off_maps_of(tp_layout, ep_layout, items, ep_layout.max_count());
  }
  const int64_t T = static_cast<int64_t>(tokens_.size());
  const int64_t K = c.top_k;
  grow(h_, T * H);
  grow(x_, T * H);
  grow(o_, T * c.q_dim());
  grow(acc_, T * H);
  grow(topk_expert_, T * K);
  grow(topk_weight_, T * K);
  grow(y_, T * K * H);
  grow(act_, T * K * c.intermediate);
  grow(gate_, T * K * c.intermediate);
  grow(row_, std::max(H, c.intermediate));
  grow(cos_, T * D / 2);
  grow(sin_, T * D / 2);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(&h_[static_cast<size_t>(t * H)],
                &weights_.embed[static_cast<size_t>(token_ids_[static_cast<size_t>(t)] * H)],
                static_cast<size_t>(H) * sizeof(float));
    const double pos = static_cast<double>(tokens_[static_cast<size_t>(t)].position);
    for (int64_t i = 0; i < D / 2; ++i) {
      const double a = pos * inv_freq_[static_cast<size_t>(i)];
      cos_[static_cast<size_t>(t * D / 2 + i)] = std::cos(a);
      sin_[static_cast<size_t>(t * D / 2 + i)] = std::sin(a);
    }
  }

  // Where each item's tokens start in the batch.
  item_first_.assign(items.size() + 1, 0);
  for (size_t i = 0; i < items.size(); ++i)
    item_first_[i + 1] = item_first_[i] + static_cast<int64_t>(items[i].tokens.size());

  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const layer_weights& lw = weights_.layers[static_cast<size_t>(layer)];
    if (layout.hybrid() && layer > 0 &&
        layout.attention_mode(layer) != layout.attention_mode(layer - 1))
      hand_off(layout.attention_mode(layer), ep_layout, maps);
    for (int64_t t = 0; t < T; ++t)
      rmsnorm(&h_[static_cast<size_t>(t * H)], lw.input_layernorm.data(), H, c.rms_eps,
              &x_[static_cast<size_t>(t * H)]);
    if (layout.attention_mode(layer) == parallel_mode::tp)
      attention_tp(layer, layout.tables_of_layer(layer), items);
    else
      attention_ep(layer, layout.tables_of_layer(layer), items);
    add_residual(T);

    for (int64_t t = 0; t < T; ++t)
      rmsnorm(&h_[static_cast<size_t>(t * H)], lw.post_attention_layernorm.data(), H, c.rms_eps,
              &x_[static_cast<size_t>(t * H)]);
    route(layer, T);
    // Hybrid and static alike: the arena holds layer l in TP iff l < cursor.
    if (moebius::arena_geometry::mode_of(layout.cursor, layer) == parallel_mode::tp)
      moe_tp(layer, T);
    else
      moe_ep(layer, T);
    add_residual(T);
  }

  std::vector<int32_t> next(items.size(), -1);
  if (logits) logits->clear();
  std::vector<double> hn(static_cast<size_t>(H));
  std::vector<float> row(static_cast<size_t>(V));
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].sample) continue;
    const int64_t t = item_first_[i + 1] - 1;
    rmsnorm(&h_[static_cast<size_t>(t * H)], weights_.norm.data(), H, c.rms_eps, hn.data());
    int32_t best = 0;
    for (int64_t v = 0; v < V; ++v) {
      row[static_cast<size_t>(v)] =
          static_cast<float>(dot(&lm_head_[static_cast<size_t>(v * H)], hn.data(), H));
      if (row[static_cast<size_t>(v)] > row[static_cast<size_t>(best)])
        best = static_cast<int32_t>(v);
    }
    next[i] = best;
    if (logits) logits->push_back(row);
  }
  return next;
}

// The activation hand-off at a mode boundary of a hybrid step, simulated with one buffer
// per rank. Before a TP layer every rank holds every row of h (replicated, as the all-reduce
// leaves it); before an EP layer (data-parallel attention) a rank holds the rows of its own
// sequences. Which rows, in which order: layer_schedule.hpp (the GPU runtime uploads the same
// maps).
//   to EP: each rank keeps its own sequences' rows of the replicated h and drops the rest.
//   to TP: all-gather: every rank receives each owner's rows (gathered in rank order).
// The rows are copied, never recomputed, so the hand-off is exact; h_ ends up as the
// gathered (to TP) or owner-held (to EP) rows.
void host_runtime::hand_off(parallel_mode to, const token_layout& ep, const hand_off_maps& maps) {
  const int P = num_ranks();
  const int64_t H = weights_.config.hidden, T = static_cast<int64_t>(tokens_.size());
  const int64_t stride = ep.max_count();
  int64_t owned = 0;
  for (int64_t n : ep.count) owned += n;
  MOEBIUS_CHECK(owned == T, errc::internal, "hand-off: ", owned, " of ", T, " rows owned");
  grow(rank_rows_, P * stride * H);
  const auto row = [&](std::vector<float>& v, int64_t r) { return &v[static_cast<size_t>(r * H)]; };
  const size_t row_bytes = static_cast<size_t>(H) * sizeof(float);
  // Each rank's buffer (`stride` rows): the rows it holds after the hand-off (to EP) or
  // contributes to the all-gather (to TP): in both directions its own sequences' rows, in its
  // EP layout's order. h_ is in batch order, which is the TP layout's.
  for (int r = 0; r < P; ++r)
    for (int64_t e = 0; e < ep.count[static_cast<size_t>(r)]; ++e)
      std::memcpy(row(rank_rows_, r * stride + e),
                  row(h_, maps.to_ep[static_cast<size_t>(r)][static_cast<size_t>(e)]), row_bytes);
  // Unpack: to TP every rank receives every buffer (all-gather) and picks each batch row out of
  // its owner's (to_tp, the same on every rank); to EP each rank reads back only its own. h_
  // stands for every rank's stream in batch order, so in both row t comes back to position t.
  if (to == parallel_mode::tp) {
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(row(h_, t), row(rank_rows_, maps.to_tp[0][static_cast<size_t>(t)]), row_bytes);
  } else {
    for (int r = 0; r < P; ++r)
      for (int64_t e = 0; e < ep.count[static_cast<size_t>(r)]; ++e)
        std::memcpy(row(h_, maps.to_ep[static_cast<size_t>(r)][static_cast<size_t>(e)]),
                    row(rank_rows_, r * stride + e), row_bytes);
  }
}

// h = float(h + float(acc)): the block's output (acc_, summed in double) joins the stream.
void host_runtime::add_residual(int64_t T) {
  const int64_t n = T * weights_.config.hidden;
  for (int64_t j = 0; j < n; ++j)
    h_[static_cast<size_t>(j)] =
        h_[static_cast<size_t>(j)] + static_cast<float>(acc_[static_cast<size_t>(j)]);
}

void host_runtime::attend(int64_t layer, int rank, parallel_mode mode,
                          const moebius::kv_sequence& seq, int64_t item_index,
                          const step_item& item, int64_t q0, int64_t q1, int64_t kv0, int64_t kv1) {
  const model_config& c = weights_.config;
  const layer_weights& lw = weights_.layers[static_cast<size_t>(layer)];
  const dense_layer& dw = dense_[static_cast<size_t>(layer)];
  const moebius::kv_geometry& g = kv_geometry_;
  const int64_t H = c.hidden, D = c.head_dim, qdim = c.q_dim(), ps = g.page_size;
  const int64_t n = static_cast<int64_t>(item.tokens.size());
  const int64_t end = item.start_position + n;  // positions [0, end) are attended
  MOEBIUS_CHECK(seq.num_tokens >= end, errc::invalid_argument, "step: sequence ", seq.seq_id,
                " on rank ", rank, " holds ", seq.num_tokens, " tokens, the step needs ", end);
  std::byte* pool = pools_[static_cast<size_t>(rank)].data();
  const int64_t first = item_first_[static_cast<size_t>(item_index)];
  // Head index within a page: EP pages hold every head, TP pages this rank's slice.
  const int64_t page_head0 =
      mode == parallel_mode::ep ? 0 : g.tp_slice_of_rank(rank) * g.heads_per_tp_page();
  auto at = [&](kv_tensor t, int64_t head, int64_t pos) {
    return pool + g.offset(mode, layer, t, seq.pages[static_cast<size_t>(pos / ps)],
                           head - page_head0, pos % ps, 0);
  };

  // 1. K and V of the new tokens for heads [kv0, kv1): projection, k_norm, RoPE, store.
  grow(kvtmp_, D);
  float* kv = kvtmp_.data();
  float* kn = kv;  // k_norm in place needs a second row
  grow(qbuf_, 2 * D);
  for (int64_t j = 0; j < n; ++j) {
    const double* x = &x_[static_cast<size_t>((first + j) * H)];
    const int64_t pos = item.start_position + j;
    const double* cs = &cos_[static_cast<size_t>((first + j) * D / 2)];
    const double* sn = &sin_[static_cast<size_t>((first + j) * D / 2)];
    for (int64_t head = kv0; head < kv1; ++head) {
      for (int64_t d = 0; d < D; ++d)
        qbuf_[static_cast<size_t>(d)] =
            static_cast<float>(dot(&dw.k_proj[static_cast<size_t>((head * D + d) * H)], x, H));
      rmsnorm(qbuf_.data(), lw.k_norm.data(), D, c.rms_eps, kn);
      rope(kn, cs, sn, D);
      store_kv(at(kv_tensor::k, head, pos), kn, D, c.kv_dtype);
      for (int64_t d = 0; d < D; ++d)
        kv[d] = static_cast<float>(dot(&dw.v_proj[static_cast<size_t>((head * D + d) * H)], x, H));
      store_kv(at(kv_tensor::v, head, pos), kv, D, c.kv_dtype);
    }
  }

  // 2. Attention of q heads [q0, q1) over positions [0, pos] read back from the pages.
  const int64_t group = c.num_q_heads / c.num_kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  grow(kbuf_, end * D);
  grow(vbuf_, end * D);
  grow(score_, end);
  grow(accd_, D);
  for (int64_t head = kv0; head < kv1; ++head) {
    const int64_t hq0 = std::max(q0, head * group), hq1 = std::min(q1, (head + 1) * group);
    if (hq0 >= hq1) continue;
    for (int64_t pos = 0; pos < end; ++pos) {
      load_kv(at(kv_tensor::k, head, pos), &kbuf_[static_cast<size_t>(pos * D)], D, c.kv_dtype);
      load_kv(at(kv_tensor::v, head, pos), &vbuf_[static_cast<size_t>(pos * D)], D, c.kv_dtype);
    }
    for (int64_t j = 0; j < n; ++j) {
      const double* x = &x_[static_cast<size_t>((first + j) * H)];
      const int64_t pos = item.start_position + j;
      const double* cs = &cos_[static_cast<size_t>((first + j) * D / 2)];
      const double* sn = &sin_[static_cast<size_t>((first + j) * D / 2)];
      for (int64_t hq = hq0; hq < hq1; ++hq) {
        float* q = &qbuf_[static_cast<size_t>(D)];
        for (int64_t d = 0; d < D; ++d)
          qbuf_[static_cast<size_t>(d)] =
              static_cast<float>(dot(&dw.q_proj[static_cast<size_t>((hq * D + d) * H)], x, H));
        rmsnorm(qbuf_.data(), lw.q_norm.data(), D, c.rms_eps, q);
        rope(q, cs, sn, D);
        double mx = -INFINITY;
        for (int64_t s = 0; s <= pos; ++s) {
          const double sc = dot(&kbuf_[static_cast<size_t>(s * D)], q, D) * scale;
          score_[static_cast<size_t>(s)] = sc;
          mx = std::max(mx, sc);
        }
        double sum = 0;
        for (int64_t s = 0; s <= pos; ++s)
          sum += (score_[static_cast<size_t>(s)] = std::exp(score_[static_cast<size_t>(s)] - mx));
        std::fill(accd_.begin(), accd_.begin() + D, 0.0);
        for (int64_t s = 0; s <= pos; ++s) {
          const double p = score_[static_cast<size_t>(s)];
          const double* v = &vbuf_[static_cast<size_t>(s * D)];
          for (int64_t d = 0; d < D; ++d) accd_[static_cast<size_t>(d)] += p * v[d];
        }
        double* o = &o_[static_cast<size_t>((first + j) * qdim + hq * D)];
        for (int64_t d = 0; d < D; ++d)
          o[d] = static_cast<float>(accd_[static_cast<size_t>(d)] / sum);
      }
    }
  }
}

void host_runtime::attention_ep(int64_t layer, const moebius::kv_state& tables,
                                std::span<const step_item> items) {
  const model_config& c = weights_.config;
  const int P = num_ranks();
  for (size_t i = 0; i < items.size(); ++i) {
    const moebius::kv_sequence* seq = nullptr;
    int owner = 0;
    for (; owner < P && !seq; ++owner) seq = find_sequence(tables, owner, items[i].seq_id);
    MOEBIUS_CHECK(seq != nullptr, errc::invalid_argument, "step: sequence ", items[i].seq_id,
                  " is in no rank's EP tables");
    attend(layer, owner - 1, parallel_mode::ep, *seq, static_cast<int64_t>(i), items[i], 0,
           c.num_q_heads, 0, c.num_kv_heads);
  }
  // o_proj on the owner over all heads: one sum.
  const dense_layer& dw = dense_[static_cast<size_t>(layer)];
  const int64_t H = c.hidden, qdim = c.q_dim(), T = static_cast<int64_t>(tokens_.size());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t r = 0; r < H; ++r)
      acc_[static_cast<size_t>(t * H + r)] =
          dot(&dw.o_proj[static_cast<size_t>(r * qdim)], &o_[static_cast<size_t>(t * qdim)], qdim);
}

void host_runtime::attention_tp(int64_t layer, const moebius::kv_state& tables,
                                std::span<const step_item> items) {
  const model_config& c = weights_.config;
  const moebius::kv_geometry& g = kv_geometry_;
  const int P = num_ranks();
  const dense_layer& dw = dense_[static_cast<size_t>(layer)];
  const int64_t H = c.hidden, D = c.head_dim, qdim = c.q_dim(),
                T = static_cast<int64_t>(tokens_.size());
  std::fill(acc_.begin(), acc_.begin() + T * H, 0.0);
  for (int r = 0; r < P; ++r) {
    const int64_t q0 = r * c.num_q_heads / P, q1 = (r + 1) * c.num_q_heads / P;
    const int64_t kv0 = g.tp_slice_of_rank(r) * g.heads_per_tp_page();
    const int64_t kv1 = kv0 + g.heads_per_tp_page();
    for (size_t i = 0; i < items.size(); ++i) {
      const moebius::kv_sequence* seq = find_sequence(tables, r, items[i].seq_id);
      MOEBIUS_CHECK(seq != nullptr, errc::invalid_argument, "step: sequence ", items[i].seq_id,
                    " is not in TP rank ", r, "'s tables");
      attend(layer, r, parallel_mode::tp, *seq, static_cast<int64_t>(i), items[i], q0, q1, kv0,
             kv1);
    }
    // This rank's o_proj partial over its heads' columns, then the all-reduce (rank order).
    const int64_t len = (q1 - q0) * D;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t row = 0; row < H; ++row)
        acc_[static_cast<size_t>(t * H + row)] +=
            dot(&dw.o_proj[static_cast<size_t>(row * qdim + q0 * D)],
                &o_[static_cast<size_t>(t * qdim + q0 * D)], len);
  }
}

void host_runtime::route(int64_t layer, int64_t T) {
  const model_config& c = weights_.config;
  const dense_layer& dw = dense_[static_cast<size_t>(layer)];
  const int64_t H = c.hidden, E = c.num_experts, K = c.top_k;
  grow(probs_, E);
  for (int64_t t = 0; t < T; ++t) {
    const double* x = &x_[static_cast<size_t>(t * H)];
    double mx = -INFINITY;
    for (int64_t e = 0; e < E; ++e) {
      probs_[static_cast<size_t>(e)] = dot(&dw.router[static_cast<size_t>(e * H)], x, H);
      mx = std::max(mx, probs_[static_cast<size_t>(e)]);
    }
    double sum = 0;
    for (int64_t e = 0; e < E; ++e)
      sum += (probs_[static_cast<size_t>(e)] = std::exp(probs_[static_cast<size_t>(e)] - mx));
    for (int64_t e = 0; e < E; ++e) probs_[static_cast<size_t>(e)] /= sum;
    // Top-k by probability, the lower expert first on ties; weights renormalised to sum to 1
    // (norm_topk_prob) or the softmax probabilities as they are.
    double top = 0;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t j = 0; j < k; ++j) taken |= topk_expert_[static_cast<size_t>(t * K + j)] == e;
        if (!taken &&
            (best < 0 || probs_[static_cast<size_t>(e)] > probs_[static_cast<size_t>(best)]))
          best = e;
      }
      topk_expert_[static_cast<size_t>(t * K + k)] = static_cast<int32_t>(best);
      top += probs_[static_cast<size_t>(best)];
    }
    for (int64_t k = 0; k < K; ++k)
      topk_weight_[static_cast<size_t>(t * K + k)] =
          probs_[static_cast<size_t>(topk_expert_[static_cast<size_t>(t * K + k)])] /
          (c.norm_topk_prob ? top : 1.0);
  }
  // Tokens per expert: pairs (t, k) as indices t*K + k, grouped by expert.
  expert_first_.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t p = 0; p < T * K; ++p)
    ++expert_first_[static_cast<size_t>(topk_expert_[static_cast<size_t>(p)] + 1)];
  for (int64_t e = 0; e < E; ++e)
    expert_first_[static_cast<size_t>(e + 1)] += expert_first_[static_cast<size_t>(e)];
  grow(pairs_, T * K);
  std::vector<int64_t>& fill = expert_fill_;
  fill.assign(expert_first_.begin(), expert_first_.end() - 1);
  for (int64_t p = 0; p < T * K; ++p)
    pairs_[static_cast<size_t>(fill[static_cast<size_t>(topk_expert_[static_cast<size_t>(p)])]++)] =
        p;
}

// One expert's slice on one rank: SiLU(gate)*up for rows [i0, i1) of each half, then the
// down projection over those columns. `mode` picks the view (and so the slot and the rank
// whose arena holds them); the loops are the same in both modes.
void host_runtime::run_expert(int64_t layer, parallel_mode mode, int rank, int64_t e, int64_t i0,
                              int64_t i1) {
  const model_config& c = weights_.config;
  const moebius::arena_geometry& ag = arena_geometry_;
  const int64_t H = c.hidden, I = c.intermediate, K = c.top_k, b = c.fp8_block;
  const int64_t p0 = expert_first_[static_cast<size_t>(e)],
                p1 = expert_first_[static_cast<size_t>(e + 1)];
  const std::byte* arena = arenas_[static_cast<size_t>(rank)].data();
  const bool fp8 = c.fp8_experts();
  const bool f32 = c.expert_dtype == dtype::fp32;  // read in place, no decode
  const int64_t eb = moebius::dtype_bytes(c.expert_dtype);
  auto locate = [&](weight_tensor t, int64_t row, int64_t col) -> const std::byte* {
    const moebius::element_location at =
        mode == parallel_mode::ep
            ? moebius::make_view<parallel_mode::ep>(ag.shape, t, ag.num_ranks).locate(e, row, col)
            : moebius::make_view<parallel_mode::tp>(ag.shape, t, ag.num_ranks).locate(e, row, col);
    MOEBIUS_CHECK(at.rank == rank, errc::internal, "expert ", e, " row ", row, " col ", col, " of ",
                  moebius::to_string(t), " is on rank ", at.rank, ", not ", rank);
    const int64_t elem = (t == weight_tensor::w13 || t == weight_tensor::w2) ? eb : 4;
    return arena + ag.tensor_base(mode, layer, t) + at.offset * elem;
  };
  // Gate rows [i0, i1), then up rows [I + i0, I + i1).
  for (int half = 0; half < 2; ++half)
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = half * I + i;
      const std::byte* w = locate(weight_tensor::w13, row, 0);
      if (!f32)
        dequant_row(w, c.expert_dtype, fp8 ? locate(weight_tensor::w13_scale, row / b, 0) : nullptr,
                    b, H, row_.data());
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t pair = pairs_[static_cast<size_t>(p)];
        const double* x = &x_[static_cast<size_t>((pair / K) * H)];
        const double v = f32 ? dot(as_floats(w), x, H) : dot(row_.data(), x, H);
        if (half == 0) {
          gate_[static_cast<size_t>(pair * I + i)] = v;
        } else {
          const double gt = gate_[static_cast<size_t>(pair * I + i)];
          act_[static_cast<size_t>(pair * I + i)] =
              static_cast<float>(gt / (1.0 + std::exp(-gt)) * v);
        }
      }
    }
  // Down: y[pair][h] = w2[h, i0:i1] . act[pair][i0:i1].
  const int64_t len = i1 - i0;
  for (int64_t h = 0; h < H; ++h) {
    const std::byte* w = locate(weight_tensor::w2, h, i0);
    if (!f32)
      dequant_row(w, c.expert_dtype, fp8 ? locate(weight_tensor::w2_scale, h / b, i0 / b) : nullptr,
                  b, len, row_.data());
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t pair = pairs_[static_cast<size_t>(p)];
      const double* a = &act_[static_cast<size_t>(pair * I + i0)];
      y_[static_cast<size_t>(pair * H + h)] =
          f32 ? dot(as_floats(w), a, len) : dot(row_.data(), a, len);
    }
  }
}

void host_runtime::moe_ep(int64_t layer, int64_t T) {
  const model_config& c = weights_.config;
  const int64_t E = c.num_experts, H = c.hidden, K = c.top_k;
  const int64_t per_rank = E / num_ranks();
  // Dispatch: each expert runs whole on its owner over the tokens routed to it.
  for (int64_t e = 0; e < E; ++e)
    if (expert_first_[static_cast<size_t>(e + 1)] > expert_first_[static_cast<size_t>(e)])
      run_expert(layer, parallel_mode::ep, static_cast<int>(e / per_rank), e, 0, c.intermediate);
  // Combine on the token's home, in top-k order.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += topk_weight_[static_cast<size_t>(t * K + k)] *
             y_[static_cast<size_t>((t * K + k) * H + h)];
      acc_[static_cast<size_t>(t * H + h)] = s;
    }
}

void host_runtime::moe_tp(int64_t layer, int64_t T) {
  const model_config& c = weights_.config;
  const int P = num_ranks();
  const int64_t E = c.num_experts, H = c.hidden, K = c.top_k, slice = c.intermediate / P;
  std::fill(acc_.begin(), acc_.begin() + T * H, 0.0);
  for (int r = 0; r < P; ++r) {
    for (int64_t e = 0; e < E; ++e)
      if (expert_first_[static_cast<size_t>(e + 1)] > expert_first_[static_cast<size_t>(e)])
        run_expert(layer, parallel_mode::tp, r, e, r * slice, (r + 1) * slice);
    // This rank's partial over the token's experts (top-k order), then the all-reduce.
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k)
          s += topk_weight_[static_cast<size_t>(t * K + k)] *
               y_[static_cast<size_t>((t * K + k) * H + h)];
        acc_[static_cast<size_t>(t * H + h)] += s;
      }
  }
}

}  // namespace mini_engine
