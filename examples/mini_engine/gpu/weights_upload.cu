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
