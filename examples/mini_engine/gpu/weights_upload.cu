// The model's weights into every rank's buffers and arena: the dense weights replicated in
// the dense dtype, the experts where the core library's placement puts them; or, for
// benchmarks, random weights drawn on the device.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <moebius/error.hpp>

#include "numerics.hpp"
#include "runtime_impl.hpp"

namespace mini_engine::gpu {

using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;

namespace {

// Host floats as `t` bytes.
std::vector<std::byte> encode(std::span<const float> v, dtype t) {
  std::vector<std::byte> out(v.size() * static_cast<size_t>(moebius::dtype_bytes(t)));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == dtype::bf16) {
      const uint16_t b = to_bf16(v[i]);
      std::memcpy(out.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    }
  }
  return out;
}

}  // namespace

// Dense weights replicated on every rank in the dense dtype; experts placed by the core
// library (place_layer_experts_in_slot: every element to its home in its layer's mode at
// o.cursor, fp8 as codes under their block scales with the scales beside them) into a host
// image of the layer's slot on each rank, then copied (what placement leaves unwritten is
// zero, as the cudaMalloc'd and cleared arena is).
void gpu_runtime::impl::upload_weights(const model_weights& w) {
  validate(w);
  MOEBIUS_CHECK(w.config.num_layers == c.num_layers, errc::invalid_argument,
                "gpu_runtime: ", w.config.num_layers, " layers of weights for a model of ",
                c.num_layers);
  const dtype dd = o.dense_dtype;
  auto put = [](void* dst, const std::vector<std::byte>& b) {
    MOEBIUS_CUDA_CHECK(cudaMemcpy(dst, b.data(), b.size(), cudaMemcpyHostToDevice));
  };
  auto put_f = [](float* dst, std::span<const float> s) {
    MOEBIUS_CUDA_CHECK(cudaMemcpy(dst, s.data(), s.size() * 4, cudaMemcpyHostToDevice));
  };
  const auto embed = encode(w.embed, dd), lm = encode(w.lm_head, dd);
  for (rank_state& rs : ranks) {
    set_device(rs);
    put(rs.embed, embed);
    put(rs.lm_head, lm);
    put_f(rs.final_norm, w.norm);
  }
  for (int64_t li = 0; li < c.num_layers; ++li) {
    const layer_weights& l = w.layers[static_cast<size_t>(li)];
    std::vector<float> qkv(l.q_proj.begin(), l.q_proj.end());
    qkv.insert(qkv.end(), l.k_proj.begin(), l.k_proj.end());
    qkv.insert(qkv.end(), l.v_proj.begin(), l.v_proj.end());
    const auto qkv_b = encode(qkv, dd), o_b = encode(l.o_proj, dd);
    for (rank_state& rs : ranks) {
      set_device(rs);
      const auto& dl = rs.layers[static_cast<size_t>(li)];
      put(dl.qkv, qkv_b);
      put(dl.o, o_b);
      put_f(dl.router, l.router);
      put_f(dl.ln1, l.input_layernorm);
      put_f(dl.ln2, l.post_attention_layernorm);
      put_f(dl.q_norm, l.q_norm);
      put_f(dl.k_norm, l.k_norm);
    }
  }
  // Experts, layer by layer through one slot-sized image per rank: the layers of one mode
  // fill the same bytes of their slots, so the images are reused without clearing, and
  // cleared where the mode changes; what no layer writes stays zero, as on the device.
  moebius::validate(arena, o.cursor);
  std::vector<std::vector<std::byte>> images(
      static_cast<size_t>(P), std::vector<std::byte>(static_cast<size_t>(arena.slot_bytes)));
  std::vector<std::span<std::byte>> spans(images.begin(), images.end());
  for (int64_t li = 0; li < c.num_layers; ++li) {
    const parallel_mode m = moebius::arena_geometry::mode_of(o.cursor, li);
    if (li > 0 && m != moebius::arena_geometry::mode_of(o.cursor, li - 1))
      for (auto& image : images) std::fill(image.begin(), image.end(), std::byte{0});
    place_layer_experts_in_slot(w, arena, li, m, spans);
    const int64_t at = arena.slot_offset(moebius::arena_geometry::slot_of(m, li));
    for (int r = 0; r < P; ++r) {
      rank_state& rs = ranks[static_cast<size_t>(r)];
      set_device(rs);
      put(rs.arena + at, images[static_cast<size_t>(r)]);
    }
  }
}

// Each tensor as it arrives: dense ones encoded in chunks and copied to every rank; experts
// into per-layer slot images (zeroed, as the cleared arena is), uploaded once complete.
void gpu_runtime::impl::stream_weights(const std::function<void(weight_sink&)>& load) {
  moebius::validate(arena, o.cursor);
  class sink final : public weight_sink {
   public:
    explicit sink(impl& rt) : rt_(rt) {
      const model_config& m = rt.c;
      seen_.assign(static_cast<size_t>(3 + m.num_layers * (9 + 3 * m.num_experts)), 0);
      images_.resize(static_cast<size_t>(m.num_layers));
      parts_.assign(static_cast<size_t>(m.num_layers), 0);
    }
    void put(hf_tensor t, int64_t layer, int64_t e, const tensor_source& src) override {
      const model_config& m = rt_.c;
      const bool global = t == hf_tensor::embed || t == hf_tensor::lm_head || t == hf_tensor::norm;
      MOEBIUS_CHECK(global || (layer >= 0 && layer < m.num_layers &&
                               (!is_expert(t) || (e >= 0 && e < m.num_experts))),
                    errc::invalid_argument, "gpu_runtime: tensor ", src.name, " of layer ", layer,
                    " expert ", e, " is outside the model");
      const int64_t first_layer = static_cast<int64_t>(hf_tensor::input_layernorm);
      const int64_t first_expert = static_cast<int64_t>(hf_tensor::gate_proj);
      const int64_t idx = global ? static_cast<int64_t>(t)
                          : is_expert(t)
                              ? 3 + m.num_layers * 9 + (layer * m.num_experts + e) * 3 +
                                    (static_cast<int64_t>(t) - first_expert)
                              : 3 + layer * 9 + (static_cast<int64_t>(t) - first_layer);
      MOEBIUS_CHECK(seen_[static_cast<size_t>(idx)] == 0, errc::invalid_argument,
                    "gpu_runtime: tensor ", src.name, " delivered twice");
      seen_[static_cast<size_t>(idx)] = 1;
      if (is_expert(t)) return expert(t, layer, e, src);
      const dtype dd = rt_.o.dense_dtype;
      const int64_t eb = moebius::dtype_bytes(dd);
      auto dense = [&](auto pick, int64_t offset_rows) {
        for (rank_state& rs : rt_.ranks) {
          rt_.set_device(rs);
          put_rows(pick(rs) + offset_rows * src.cols * eb, dd, src);
        }
      };
      auto f32 = [&](auto pick) {
        for (rank_state& rs : rt_.ranks) {
          rt_.set_device(rs);
          put_rows(reinterpret_cast<std::byte*>(pick(rs)), dtype::fp32, src);
        }
      };
      auto L = [layer](rank_state& rs) -> rank_state::layer& {
        return rs.layers[static_cast<size_t>(layer)];
      };
      switch (t) {
        case hf_tensor::embed: return dense([](rank_state& rs) { return rs.embed; }, 0);
        case hf_tensor::lm_head: return dense([](rank_state& rs) { return rs.lm_head; }, 0);
        case hf_tensor::norm: return f32([](rank_state& rs) { return rs.final_norm; });
        case hf_tensor::q_proj: return dense([&](rank_state& rs) { return L(rs).qkv; }, 0);
        case hf_tensor::k_proj: return dense([&](rank_state& rs) { return L(rs).qkv; }, m.q_dim());
        case hf_tensor::v_proj:
          return dense([&](rank_state& rs) { return L(rs).qkv; }, m.q_dim() + m.kv_dim());
        case hf_tensor::o_proj: return dense([&](rank_state& rs) { return L(rs).o; }, 0);
        case hf_tensor::router: return f32([&](rank_state& rs) { return L(rs).router; });
        case hf_tensor::input_layernorm: return f32([&](rank_state& rs) { return L(rs).ln1; });
        case hf_tensor::post_attention_layernorm:
          return f32([&](rank_state& rs) { return L(rs).ln2; });
        case hf_tensor::q_norm: return f32([&](rank_state& rs) { return L(rs).q_norm; });
        case hf_tensor::k_norm: return f32([&](rank_state& rs) { return L(rs).k_norm; });
        default: return;
      }
    }
    int64_t missing() const {
      return static_cast<int64_t>(std::count(seen_.begin(), seen_.end(), 0));
    }

   private:
    // `src` encoded as `t` into device memory at `dst`, through a staging chunk of at most
    // 64 MiB (whole rows; a BF16 source into bf16 is copied as it is).
    void put_rows(std::byte* dst, dtype t, const tensor_source& src) {
      const int64_t eb = moebius::dtype_bytes(t), row = src.cols * eb;
      const int64_t rows_per = std::max<int64_t>(1, (int64_t{64} << 20) / std::max<int64_t>(1, row));
      for (int64_t r0 = 0; r0 < src.rows; r0 += rows_per) {
        const int64_t n = std::min(rows_per, src.rows - r0);
        const std::byte* from = nullptr;
        if (src.dtype == t) {
          from = src.at(r0, 0);
        } else {
          staging_.resize(static_cast<size_t>(n * row));
          for (int64_t r = 0; r < n; ++r)
            for (int64_t q = 0; q < src.cols; ++q) {
              const float v = static_cast<float>(src.value(r0 + r, q));
              std::byte* p = staging_.data() + (r * src.cols + q) * eb;
              if (t == dtype::bf16) {
                const uint16_t u = to_bf16(v);
                std::memcpy(p, &u, 2);
              } else {
                std::memcpy(p, &v, 4);
              }
            }
          from = staging_.data();
        }
        MOEBIUS_CUDA_CHECK(cudaMemcpy(dst + r0 * row, from, static_cast<size_t>(n * row),
                                      cudaMemcpyHostToDevice));
      }
    }
    void expert(hf_tensor t, int64_t layer, int64_t e, const tensor_source& src) {
      const parallel_mode mode = moebius::arena_geometry::mode_of(rt_.o.cursor, layer);
      const int64_t slot = moebius::arena_geometry::slot_of(mode, layer);
      auto& images = images_[static_cast<size_t>(layer)];
      if (images.empty())
        images.assign(static_cast<size_t>(rt_.P),
                      std::vector<std::byte>(static_cast<size_t>(rt_.arena.slot_bytes)));
      std::vector<std::span<std::byte>> spans(images.begin(), images.end());
      place_expert_part(rt_.c, rt_.arena, layer, mode, e, t, src, spans,
                        rt_.arena.slot_offset(slot));
      if (++parts_[static_cast<size_t>(layer)] < 3 * rt_.c.num_experts) return;
      for (int r = 0; r < rt_.P; ++r) {
        rank_state& rs = rt_.ranks[static_cast<size_t>(r)];
        rt_.set_device(rs);
        MOEBIUS_CUDA_CHECK(cudaMemcpy(rs.arena + rt_.arena.slot_offset(slot),
                                      images[static_cast<size_t>(r)].data(),
                                      images[static_cast<size_t>(r)].size(),
                                      cudaMemcpyHostToDevice));
      }
      images = {};  // freed: the layer is on the devices
    }

    impl& rt_;
    std::vector<char> seen_;
    std::vector<std::vector<std::vector<std::byte>>> images_;  // [L][P][slot_bytes], in flight
    std::vector<int64_t> parts_;                               // [L] expert matrices placed
    std::vector<std::byte> staging_;
  } s(*this);
  load(s);
  MOEBIUS_CHECK(s.missing() == 0, errc::invalid_argument, "gpu_runtime: the loader left ",
                s.missing(), " tensors of the model unwritten");
}

void gpu_runtime::impl::random_weights(uint64_t seed) {
  const int64_t H = c.hidden, D = c.head_dim, E = c.num_experts;
  const dtype dd = o.dense_dtype;
  uint64_t s = seed;
  auto fill = [&](rank_state& rs, void* p, dtype t, int64_t n, float scale, float offset = 0.0f) {
    launch_fill_random({p, t, n, s += 0x1234567ull, scale, offset}, rs.stream);
  };
  for (rank_state& rs : ranks) {
    set_device(rs);
    fill(rs, rs.embed, dd, c.vocab * H, 1.0f);
    fill(rs, rs.lm_head, dd, c.vocab * H, 2.0f * std::sqrt(3.0f / static_cast<float>(H)));
    fill(rs, rs.final_norm, dtype::fp32, H, 0.1f, 1.0f);
    for (auto& l : rs.layers) {
      fill(rs, l.qkv, dd, qkv_ld * H, std::sqrt(3.0f / static_cast<float>(H)));
      fill(rs, l.o, dd, H * c.num_q_heads * D,
           std::sqrt(3.0f / static_cast<float>(c.num_q_heads * D)));
      fill(rs, l.router, dtype::fp32, E * H, std::sqrt(3.0f / static_cast<float>(H)));
      fill(rs, l.ln1, dtype::fp32, H, 0.1f, 1.0f);
      fill(rs, l.ln2, dtype::fp32, H, 0.1f, 1.0f);
      fill(rs, l.q_norm, dtype::fp32, D, 0.1f, 1.0f);
      fill(rs, l.k_norm, dtype::fp32, D, 0.1f, 1.0f);
    }
    // The whole arena: every slot holds plausible weights in either view. fp8: codes
    // uniform over [-448, 448) and every scale one power of two near sqrt(3/H) / 448, so the
    // weights have the usual size.
    if (fp8) {
      fill(rs, rs.arena, dtype::fp8_e4m3, arena.total_bytes(), 448.0f);
      const float sc =
          std::exp2(std::round(std::log2(std::sqrt(3.0f / static_cast<float>(H)) / fp8_e4m3_max)));
      for (int64_t slot = 0; slot < arena.num_slots(); ++slot)
        for (moebius::weight_tensor t :
             {moebius::weight_tensor::w13_scale, moebius::weight_tensor::w2_scale}) {
          const int ti = static_cast<int>(t);
          launch_fill_random({rs.arena + arena.slot_offset(slot) + arena.tensor_offset[ti],
                              dtype::fp32, arena.tensor_bytes[ti] / 4, 0, 0.0f, sc},
                             rs.stream);
        }
    } else {
      fill(rs, rs.arena, c.expert_dtype, arena.total_bytes() / moebius::dtype_bytes(c.expert_dtype),
           std::sqrt(3.0f / static_cast<float>(H)));
    }
    MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(rs.stream));
  }
}

}  // namespace mini_engine::gpu
