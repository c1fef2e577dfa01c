#include "weights.hpp"

#include <cmath>
#include <cstring>
#include <moebius/error.hpp>
#include <moebius/layout/weight_view.hpp>
#include <string>

#include "numerics.hpp"

namespace mini_engine {

using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;
using moebius::weight_tensor;

namespace {

std::vector<float> zeros(int64_t n) {
  return std::vector<float>(static_cast<size_t>(n), 0.0f);
}

struct tensor_ref {
  const char* name;
  std::vector<float> layer_weights::*member;
  int64_t elements;
};

// Every tensor of a layer with its expected element count, in generation order.
std::vector<tensor_ref> layer_tensors(const model_config& c) {
  const int64_t H = c.hidden, E = c.num_experts, I = c.intermediate, D = c.head_dim;
  std::vector<tensor_ref> t = {
      {"input_layernorm", &layer_weights::input_layernorm, H},
      {"q_proj", &layer_weights::q_proj, c.q_dim() * H},
      {"k_proj", &layer_weights::k_proj, c.kv_dim() * H},
      {"v_proj", &layer_weights::v_proj, c.kv_dim() * H},
      {"o_proj", &layer_weights::o_proj, H * c.q_dim()},
      {"q_norm", &layer_weights::q_norm, D},
      {"k_norm", &layer_weights::k_norm, D},
      {"post_attention_layernorm", &layer_weights::post_attention_layernorm, H},
      {"router", &layer_weights::router, E * H},
      {"w13", &layer_weights::w13, E * 2 * I * H},
      {"w2", &layer_weights::w2, E * H * I},
  };
  if (c.fp8_experts()) {
    const int64_t b = c.fp8_block;
    t.push_back({"w13_scale", &layer_weights::w13_scale, E * (2 * I / b) * (H / b)});
    t.push_back({"w2_scale", &layer_weights::w2_scale, E * (H / b) * (I / b)});
  }
  return t;
}

// The smallest power of two s with amax / s <= 448 (1 for an all-zero block).
float pow2_scale(float amax) {
  if (!(amax > 0)) return 1.0f;
  int e;
  const double m = std::frexp(static_cast<double>(amax) / fp8_e4m3_max, &e);  // m in [0.5,1)
  return static_cast<float>(std::ldexp(1.0, m == 0.5 ? e - 1 : e));
}

// Quantizes one [E, rows, cols] tensor to fp8 blocks of b x b in place; fills `scales`.
void round_fp8(std::vector<float>& t, std::vector<float>& scales, int64_t E, int64_t rows,
               int64_t cols, int64_t b) {
  const int64_t br = rows / b, bc = cols / b;
  scales.assign(static_cast<size_t>(E * br * bc), 1.0f);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < br; ++i)
      for (int64_t j = 0; j < bc; ++j) {
        float amax = 0;
        for (int64_t r = i * b; r < (i + 1) * b; ++r)
          for (int64_t q = j * b; q < (j + 1) * b; ++q)
            amax = std::fmax(amax, std::fabs(t[static_cast<size_t>((e * rows + r) * cols + q)]));
        const float s = pow2_scale(amax);
        scales[static_cast<size_t>((e * br + i) * bc + j)] = s;
        for (int64_t r = i * b; r < (i + 1) * b; ++r)
          for (int64_t q = j * b; q < (j + 1) * b; ++q) {
            float& v = t[static_cast<size_t>((e * rows + r) * cols + q)];
            v = round_fp8_e4m3(v / s) * s;
          }
      }
}

}  // namespace

model_weights make_empty_weights(const model_config& c) {
  validate(c);
  model_weights w;
  w.config = c;
  w.embed = zeros(c.vocab * c.hidden);
  w.layers.resize(static_cast<size_t>(c.num_layers));
  for (auto& l : w.layers)
    for (const tensor_ref& t : layer_tensors(c)) l.*t.member = zeros(t.elements);
  w.norm = zeros(c.hidden);
  w.lm_head = zeros(c.vocab * c.hidden);
  return w;
}

model_weights make_weights(const model_config& c, uint64_t seed) {
  model_weights w = make_empty_weights(c);
  splitmix64 rng(seed);
  auto fill = [&](std::vector<float>& t, double scale) {
    for (float& v : t) v = static_cast<float>(rng.symmetric() * scale);
  };
  auto fill_norm = [&](std::vector<float>& t) {
    for (float& v : t) v = static_cast<float>(1.0 + 0.1 * rng.symmetric());
  };
  const double H = static_cast<double>(c.hidden);
  fill(w.embed, 1.0);
  for (auto& l : w.layers) {
    fill_norm(l.input_layernorm);
    fill(l.q_proj, std::sqrt(3.0 / H));
    fill(l.k_proj, std::sqrt(3.0 / H));
    fill(l.v_proj, std::sqrt(3.0 / H));
    fill(l.o_proj, std::sqrt(3.0 / static_cast<double>(c.q_dim())));
    fill_norm(l.q_norm);
    fill_norm(l.k_norm);
    fill_norm(l.post_attention_layernorm);
    fill(l.router, std::sqrt(3.0 / H) * 2.0);
    fill(l.w13, std::sqrt(3.0 / H));
    fill(l.w2, std::sqrt(3.0 / static_cast<double>(c.intermediate)));
  }
  fill_norm(w.norm);
  fill(w.lm_head, std::sqrt(3.0 / H) * 2.0);
  round_experts(w);
  return w;
}

void round_experts(model_weights& w) {
  const model_config& c = w.config;
  for (auto& l : w.layers) {
    switch (c.expert_dtype) {
      case dtype::bf16:
        for (float& v : l.w13) v = round_bf16(v);
        for (float& v : l.w2) v = round_bf16(v);
        break;
      case dtype::fp8_e4m3:
        round_fp8(l.w13, l.w13_scale, c.num_experts, 2 * c.intermediate, c.hidden, c.fp8_block);
        round_fp8(l.w2, l.w2_scale, c.num_experts, c.hidden, c.intermediate, c.fp8_block);
        break;
      default:
        break;
    }
  }
}

void validate(const model_weights& w) {
  const model_config& c = w.config;
  validate(c);
  auto check = [](const std::string& name, const std::vector<float>& t, int64_t n) {
    MOEBIUS_CHECK(static_cast<int64_t>(t.size()) == n, errc::invalid_argument, "weights: ", name,
                  " has ", t.size(), " elements, the config needs ", n);
  };
  check("embed", w.embed, c.vocab * c.hidden);
  check("norm", w.norm, c.hidden);
  check("lm_head", w.lm_head, c.vocab * c.hidden);
  MOEBIUS_CHECK(static_cast<int64_t>(w.layers.size()) == c.num_layers, errc::invalid_argument,
                "weights: ", w.layers.size(), " layers, the config needs ", c.num_layers);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    for (const tensor_ref& t : layer_tensors(c))
      check("layer " + std::to_string(i) + " " + t.name, w.layers[i].*t.member, t.elements);
  }
}

namespace {

// Writes one [E, rows, cols] float tensor (and its fp8 scales) into the view `Mode`.
// `origin`: the arena byte that arenas[r].data() holds (0: whole arenas; a slot's offset:
// images of that slot).
template <parallel_mode Mode>
void place_tensor(const model_config& c, const moebius::arena_geometry& g, int64_t layer,
                  weight_tensor t, const std::vector<float>& values,
                  const std::vector<float>& scales, std::span<const std::span<std::byte>> arenas,
                  int64_t origin) {
  const auto view = moebius::make_view<Mode>(g.shape, t, g.num_ranks);
  const int64_t base = g.tensor_base(Mode, layer, t) - origin;
  const int64_t E = view.tensor.num_experts, rows = view.tensor.rows, cols = view.tensor.cols;
  const int64_t b = c.fp8_block;
  const int64_t bc = c.fp8_experts() ? cols / b : 0;
  const int64_t br = c.fp8_experts() ? rows / b : 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t q = 0; q < cols; ++q) {
        const float v = values[static_cast<size_t>((e * rows + r) * cols + q)];
        const moebius::element_location at = view.locate(e, r, q);
        std::byte* p =
            arenas[static_cast<size_t>(at.rank)].data() + base + at.offset * view.tensor.elem_bytes;
        switch (c.expert_dtype) {
          case dtype::fp32:
            std::memcpy(p, &v, 4);
            break;
          case dtype::bf16: {
            const uint16_t u = to_bf16(v);
            std::memcpy(p, &u, 2);
            break;
          }
          default: {  // fp8: the value is code * scale exactly (round_experts)
            const float s = scales[static_cast<size_t>((e * br + r / b) * bc + q / b)];
            const uint8_t u = to_fp8_e4m3(v / s);
            // Weights that were not rounded would be stored as some other value: refuse them.
            MOEBIUS_CHECK(s > 0 && std::isfinite(s) && from_fp8_e4m3(u) * s == v,
                          errc::invalid_argument, "place_layer_experts: fp8 ",
                          moebius::to_string(t), "[", e, ", ", r, ", ", q, "] of layer ", layer,
                          " = ", v, " is not an e4m3 code times its block scale ", s,
                          " (round the experts first: round_experts)");
            std::memcpy(p, &u, 1);
            break;
          }
        }
      }
}

template <parallel_mode Mode>
void place_scales(const moebius::arena_geometry& g, int64_t layer, weight_tensor t,
                  const std::vector<float>& scales, std::span<const std::span<std::byte>> arenas,
                  int64_t origin) {
  const auto view = moebius::make_view<Mode>(g.shape, t, g.num_ranks);
  const int64_t base = g.tensor_base(Mode, layer, t) - origin;
  const int64_t E = view.tensor.num_experts, rows = view.tensor.rows, cols = view.tensor.cols;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t q = 0; q < cols; ++q) {
        const float v = scales[static_cast<size_t>((e * rows + r) * cols + q)];
        const moebius::element_location at = view.locate(e, r, q);
        std::memcpy(arenas[static_cast<size_t>(at.rank)].data() + base + at.offset * 4, &v, 4);
      }
}

template <parallel_mode Mode>
void place_layer(const model_weights& w, const moebius::arena_geometry& g, int64_t layer,
                 std::span<const std::span<std::byte>> arenas, int64_t origin) {
  const layer_weights& l = w.layers[static_cast<size_t>(layer)];
  place_tensor<Mode>(w.config, g, layer, weight_tensor::w13, l.w13, l.w13_scale, arenas, origin);
  place_tensor<Mode>(w.config, g, layer, weight_tensor::w2, l.w2, l.w2_scale, arenas, origin);
  if (w.config.fp8_experts()) {
    place_scales<Mode>(g, layer, weight_tensor::w13_scale, l.w13_scale, arenas, origin);
    place_scales<Mode>(g, layer, weight_tensor::w2_scale, l.w2_scale, arenas, origin);
  }
}

// Checks the arguments of a placement into images of `bytes` each, then places.
void place_layer_at(const model_weights& w, const moebius::arena_geometry& g, int64_t layer,
                    parallel_mode mode, std::span<const std::span<std::byte>> arenas,
                    int64_t origin, int64_t bytes, const char* who) {
  MOEBIUS_CHECK(static_cast<int>(arenas.size()) == g.num_ranks, errc::invalid_argument, who, ": ",
                arenas.size(), " arenas for ", g.num_ranks, " ranks");
  for (const auto& a : arenas)
    MOEBIUS_CHECK(static_cast<int64_t>(a.size()) >= bytes, errc::invalid_argument, who,
                  origin == 0 ? ": an arena of " : ": a slot image of ", a.size(),
                  " bytes, the geometry needs ", bytes);
  MOEBIUS_CHECK(layer >= 0 && layer < w.config.num_layers, errc::invalid_argument, who,
                ": layer ", layer, " of ", w.config.num_layers);
  if (mode == parallel_mode::ep)
    place_layer<parallel_mode::ep>(w, g, layer, arenas, origin);
  else
    place_layer<parallel_mode::tp>(w, g, layer, arenas, origin);
}

}  // namespace

namespace {

// Writes [rows, cols] `src` into tensor `t` of expert `e` of `layer` in view `Mode`, its row
// r going to logical row row0 + r. Columns [c0, c0 + run) of a row are contiguous in the
// view: the whole row, except TP of a column-split tensor (w2, w2_scale), where each rank
// holds its slice of segment_len / P columns. `convert(dst, r, c0, n)` writes n elements.
template <moebius::parallel_mode Mode, class Convert>
void place_rows(const moebius::arena_geometry& g, int64_t layer, weight_tensor t, int64_t e,
                int64_t row0, int64_t rows, int64_t cols,
                std::span<const std::span<std::byte>> arenas, int64_t origin, Convert&& convert) {
  const auto view = moebius::make_view<Mode>(g.shape, t, g.num_ranks);
  const int64_t base = g.tensor_base(Mode, layer, t) - origin;
  const int64_t run = (Mode == parallel_mode::tp && view.tensor.split_axis == 2)
                          ? view.tensor.segment_len() / g.num_ranks
                          : cols;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c0 = 0; c0 < cols; c0 += run) {
      const moebius::element_location at = view.locate(e, row0 + r, c0);
      convert(arenas[static_cast<size_t>(at.rank)].data() + base + at.offset * view.tensor.elem_bytes,
              r, c0, run);
    }
}

template <moebius::parallel_mode Mode>
void place_part(const model_config& c, const moebius::arena_geometry& g, int64_t layer, int64_t e,
                hf_tensor part, const tensor_source& src,
                std::span<const std::span<std::byte>> arenas, int64_t origin) {
  const int64_t I = c.intermediate;
  const bool down = part == hf_tensor::down_proj;
  const weight_tensor t = down ? weight_tensor::w2 : weight_tensor::w13;
  const int64_t row0 = part == hf_tensor::up_proj ? I : 0;
  switch (c.expert_dtype) {
    case dtype::fp32:
      place_rows<Mode>(g, layer, t, e, row0, src.rows, src.cols, arenas, origin,
                       [&](std::byte* dst, int64_t r, int64_t c0, int64_t n) {
                         for (int64_t j = 0; j < n; ++j) {
                           const float v = static_cast<float>(src.value(r, c0 + j));
                           std::memcpy(dst + 4 * j, &v, 4);
                         }
                       });
      break;
    case dtype::bf16:
      place_rows<Mode>(g, layer, t, e, row0, src.rows, src.cols, arenas, origin,
                       [&](std::byte* dst, int64_t r, int64_t c0, int64_t n) {
                         if (src.dtype == dtype::bf16) {
                           std::memcpy(dst, src.at(r, c0), static_cast<size_t>(2 * n));
                           return;
                         }
                         for (int64_t j = 0; j < n; ++j) {
                           const uint16_t u = to_bf16(static_cast<float>(src.value(r, c0 + j)));
                           std::memcpy(dst + 2 * j, &u, 2);
                         }
                       });
      break;
    default: {  // fp8 codes as they are, then their block scales
      place_rows<Mode>(g, layer, t, e, row0, src.rows, src.cols, arenas, origin,
                       [&](std::byte* dst, int64_t r, int64_t c0, int64_t n) {
                         std::memcpy(dst, src.at(r, c0), static_cast<size_t>(n));
                       });
      const int64_t b = c.fp8_block;
      const weight_tensor ts = down ? weight_tensor::w2_scale : weight_tensor::w13_scale;
      place_rows<Mode>(g, layer, ts, e, row0 / b, src.rows / b, src.cols / b, arenas, origin,
                       [&](std::byte* dst, int64_t r, int64_t c0, int64_t n) {
                         std::memcpy(dst, src.scales + r * src.scale_cols + c0,
                                     static_cast<size_t>(4 * n));
                       });
    }
  }
}

}  // namespace

void place_expert_part(const model_config& c, const moebius::arena_geometry& g, int64_t layer,
                       parallel_mode mode, int64_t e, hf_tensor part, const tensor_source& src,
                       std::span<const std::span<std::byte>> arenas, int64_t origin) {
  MOEBIUS_CHECK(is_expert(part), errc::invalid_argument, "place_expert_part: ", src.name,
                " is not an expert tensor");
  MOEBIUS_CHECK(layer >= 0 && layer < c.num_layers && e >= 0 && e < c.num_experts,
                errc::invalid_argument, "place_expert_part: ", src.name, ": layer ", layer,
                " expert ", e, " outside L=", c.num_layers, " E=", c.num_experts);
  const bool down = part == hf_tensor::down_proj;
  const int64_t want_rows = down ? c.hidden : c.intermediate;
  const int64_t want_cols = down ? c.intermediate : c.hidden;
  MOEBIUS_CHECK(src.rows == want_rows && src.cols == want_cols, errc::invalid_argument,
                "place_expert_part: ", src.name, " is [", src.rows, ", ", src.cols,
                "], the model needs [", want_rows, ", ", want_cols, "]");
  if (c.fp8_experts())
    MOEBIUS_CHECK(src.dtype == dtype::fp8_e4m3 && src.block == c.fp8_block && src.scales &&
                      src.scale_cols == (want_cols + c.fp8_block - 1) / c.fp8_block,
                  errc::invalid_argument, "place_expert_part: ", src.name, " is ",
                  moebius::to_string(src.dtype), " (block ", src.block,
                  "); fp8_e4m3 experts take F8_E4M3 tensors with ", c.fp8_block, "x",
                  c.fp8_block, " block scales (load bf16 experts to dequantise)");
  MOEBIUS_CHECK(static_cast<int>(arenas.size()) == g.num_ranks, errc::invalid_argument,
                "place_expert_part: ", arenas.size(), " arenas for ", g.num_ranks, " ranks");
  const int64_t slot = moebius::arena_geometry::slot_of(mode, layer);
  for (const auto& a : arenas)
    MOEBIUS_CHECK(origin <= g.slot_offset(slot) &&
                      static_cast<int64_t>(a.size()) >= g.slot_offset(slot) + g.slot_bytes - origin,
                  errc::invalid_argument, "place_expert_part: an image of ", a.size(),
                  " bytes from arena byte ", origin, " does not hold slot ", slot);
  if (mode == parallel_mode::ep)
    place_part<parallel_mode::ep>(c, g, layer, e, part, src, arenas, origin);
  else
    place_part<parallel_mode::tp>(c, g, layer, e, part, src, arenas, origin);
}

void place_layer_experts(const model_weights& w, const moebius::arena_geometry& g, int64_t layer,
                         parallel_mode mode, std::span<const std::span<std::byte>> arenas) {
  place_layer_at(w, g, layer, mode, arenas, 0, g.total_bytes(), "place_layer_experts");
}

void place_layer_experts_in_slot(const model_weights& w, const moebius::arena_geometry& g,
                                 int64_t layer, parallel_mode mode,
                                 std::span<const std::span<std::byte>> slots) {
  place_layer_at(w, g, layer, mode, slots,
                 g.slot_offset(moebius::arena_geometry::slot_of(mode, layer)), g.slot_bytes,
                 "place_layer_experts_in_slot");
}

void place_experts(const model_weights& w, const moebius::arena_geometry& g,
                   moebius::arena_cursor cursor, std::span<const std::span<std::byte>> arenas) {
  moebius::validate(g, cursor);
  for (int64_t l = 0; l < w.config.num_layers; ++l)
    place_layer_experts(w, g, l, moebius::arena_geometry::mode_of(cursor, l), arenas);
}

}  // namespace mini_engine
