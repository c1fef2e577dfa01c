#include "host_runtime.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <moebius/error.hpp>
#include <moebius/kv/page_table.hpp>
#include <moebius/layout/weight_view.hpp>

#include "host_kernels.hpp"
#include "kv_pages.hpp"
#include "numerics.hpp"

namespace mini_engine {

using moebius::dtype;
using moebius::errc;
using moebius::kv_tensor;
using moebius::parallel_mode;
using moebius::weight_tensor;
using namespace host_detail;


void host_runtime::lay_out(const host_runtime_options& options) {
  const model_config& c = weights_.config;
  validate(c, options.num_ranks);
  MOEBIUS_CHECK(options.num_ep_pages >= 1, errc::invalid_argument,
                "host_runtime: num_ep_pages must be >= 1 (got ", options.num_ep_pages, ")");
  arena_geometry_ = moebius::make_arena_geometry(expert_shape_of(c), options.num_ranks,
                                                 options.tensor_alignment, options.slot_alignment);
  moebius::validate(arena_geometry_, options.cursor);
  // The TP view's KV-parallel degree: the library's check refuses a dcp that does not divide
  // P/Hkv (naming dcp).
  kv_geometry_ =
      moebius::with_dcp(kv_geometry_of(c, options.num_ranks, options.num_ep_pages), options.dcp);
  kv_layout_ = moebius::kv_preset_layout(options.kv_preset, kv_geometry_);
  MOEBIUS_CHECK(kv_layout_.pool_bytes == kv_geometry_.pool_bytes() && kv_layout_.segment_bytes == 0,
                errc::invalid_argument, "host_runtime: the ", moebius::to_string(options.kv_preset),
                " layout needs a pool of ", kv_layout_.pool_bytes, " bytes in one allocation; the "
                "memory owner allocates ", kv_geometry_.pool_bytes());
  memory_ = std::make_unique<moebius::host_deployment_memory>(arena_geometry_, kv_geometry_,
                                                              moebius::memory_fill::zero,
                                                              options.cursor);
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
      spans_ = rt.arena_spans();
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
  mini_engine::place_experts(weights, arena_geometry_, cursor, arena_spans());
}

std::vector<moebius::rank_memory> host_runtime::memory() { return memory_->ranks(); }

std::byte* host_runtime::arena_of(int rank) const {
  return memory_->memory(rank).space(moebius::memory_space::arena).data();
}

std::byte* host_runtime::pool_of(int rank) const {
  return memory_->memory(rank).space(moebius::memory_space::kv_pool).data();
}

std::vector<std::span<std::byte>> host_runtime::arena_spans() const {
  std::vector<std::span<std::byte>> s;
  for (int r = 0; r < num_ranks(); ++r)
    s.emplace_back(arena_of(r), static_cast<size_t>(arena_geometry_.total_bytes()));
  return s;
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
  // A dcp change while serving (step_layout::dcp): the pages stay where they are, only which
  // positions a rank's pages hold changes, so the geometry is all that follows.
  if (layout.dcp > 0 && layout.dcp != kv_geometry_.dcp)
    kv_geometry_ = moebius::with_dcp(kv_geometry_, layout.dcp);
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

}  // namespace mini_engine
