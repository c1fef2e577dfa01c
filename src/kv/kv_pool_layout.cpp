#include "moebius/kv/kv_pool_layout.hpp"

#include <algorithm>
#include <ostream>
#include <utility>
#include <vector>

#include "moebius/detail/checked_math.hpp"
#include "moebius/detail/enum_check.hpp"
#include "moebius/error.hpp"

namespace moebius {

namespace {

const char* name_of(parallel_mode m) {
  return m == parallel_mode::ep ? "EP" : "TP";
}

int64_t heads_of(const kv_geometry& g, parallel_mode m) {
  return m == parallel_mode::ep ? g.heads_per_ep_page() : g.heads_per_tp_page();
}

// "layer 3 V" (latent: "layer 3").
struct tensor_name {
  const kv_geometry& g;
  int64_t k;
};
std::ostream& operator<<(std::ostream& os, const tensor_name& n) {
  os << "layer " << n.k / n.g.kv_tensors();
  if (!n.g.latent()) os << (n.k % 2 == 0 ? " K" : " V");
  return os;
}

int64_t tensor_base(const kv_geometry& g, const kv_strides& s, int64_t k) {
  return s.tensor(k / g.kv_tensors(), static_cast<kv_tensor>(k % g.kv_tensors()));
}

// Floor division for a possibly negative numerator and a positive divisor.
int64_t floor_div(int64_t a, int64_t b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

void check_view(const kv_geometry& g, const kv_pool_layout& l, parallel_mode m) {
  const kv_strides& s = l.view(m);
  const char* v = name_of(m);
  const int64_t e = dtype_bytes(g.type);
  const int64_t T = g.num_tensors();
  const int64_t N = g.num_pages(m);
  const int64_t pb = g.page_bytes(m);
  const int64_t hb = g.head_bytes();
  const int64_t heads = heads_of(g, m);
  const int64_t ps = g.page_size;
  const int64_t kv = g.latent() ? 0 : s.kv;
  MOEBIUS_CHECK(s.base >= 0 && s.layer >= 0 && kv >= 0 && s.page >= 0 && s.token >= 0 &&
                    s.head >= 0 && s.dim >= 0,
                errc::invalid_argument, "kv_pool_layout ", v,
                " view: base and strides must be >= 0 (", s, ")");
  MOEBIUS_CHECK(s.dim == e, errc::invalid_argument, "kv_pool_layout ", v,
                " view: the dim stride must be the element size, elements of a head being "
                "contiguous (dim=",
                s.dim, ", ", to_string(g.type), " = ", e, " bytes)");
  MOEBIUS_CHECK(s.base % e == 0 && s.layer % e == 0 && kv % e == 0 && s.page % e == 0,
                errc::invalid_argument, "kv_pool_layout ", v,
                " view: base, layer, K|V and page strides must be multiples of the element "
                "size ",
                e, " (", s, ")");
  // A page piece is one dense block in either order; a dimension of size 1 has no stride.
  const bool hnd = (heads == 1 || s.head == ps * hb) && (ps == 1 || s.token == hb);
  const bool nhd = (ps == 1 || s.token == heads * hb) && (heads == 1 || s.head == hb);
  MOEBIUS_CHECK(hnd || nhd, errc::invalid_argument, "kv_pool_layout ", v,
                " view: a page of one (layer, K|V) must be one dense HND or NHD block (the "
                "planner copies pages and head slices as blocks): token stride=",
                s.token, ", head stride=", s.head, "; HND needs token=", hb, ", head=", ps * hb,
                "; NHD needs token=", heads * hb, ", head=", hb);
  // tensor_base() is unchecked: the largest base (last layer, last K|V; strides are >= 0)
  // must fit in 64 bits, so that no wrapped base slips past the checks below.
  static_cast<void>(detail::checked_add(
      s.base,
      detail::checked_add(detail::checked_mul(g.num_layers - 1, s.layer, "KV layout base"),
                          detail::checked_mul(g.kv_tensors() - 1, kv, "KV layout base"),
                          "KV layout base"),
      "KV layout base"));
  if (N == 0) return;
  MOEBIUS_CHECK(N == 1 || s.page >= pb, errc::invalid_argument, "kv_pool_layout ", v,
                " view: pages of one tensor overlap: page stride ", s.page, " < page bytes ", pb);
  const int64_t extent = detail::checked_add(
      detail::checked_mul(N - 1, s.page, "KV layout extent"), pb, "KV layout extent");
  // Tensors k = layer * kv_tensors + t in ascending byte order (K -> V and each layer's last
  // tensor -> the next layer's first step forward), as the present layout and the presets lay
  // them out: then the last tensor ends last and consecutive tensors decide whether any two
  // meet, so the checks below take O(1) (O(kv tensors) when K and V of a layer interleave)
  // instead of O(T) and O(T log T) (a plan validates its layout on every call, at any number
  // of layers).
  const int64_t kvt = g.kv_tensors();
  const int64_t within = s.kv, across = s.layer - (kvt - 1) * s.kv;
  const bool ascending = (kvt == 1 || within >= 0) && (g.num_layers == 1 || across >= 0);
  const bool apart = ascending && (kvt == 1 || within >= extent) &&
                     (g.num_layers == 1 || across >= extent);
  // Whether tensor k's pages fit the pool and one segment (no overflow: every base fits).
  auto fits = [&](int64_t k) {
    const int64_t b = tensor_base(g, s, k);
    if (b > l.pool_bytes - extent) return false;
    return l.segment_bytes == 0 || b / l.segment_bytes == (b + extent - 1) / l.segment_bytes;
  };
  // Ascending, the last tensor ends last; with a layer stride that is a multiple of
  // segment_bytes, layer l crosses a segment boundary where layer 0 does. Then layer 0 and the
  // last tensor decide; otherwise (or when they do not show it) every tensor, with the error.
  bool all_fit = ascending && fits(T - 1) &&
                 (l.segment_bytes == 0 || g.num_layers == 1 || s.layer % l.segment_bytes == 0);
  for (int64_t k = 0; k < kvt && all_fit; ++k) all_fit = fits(k);
  // Every tensor's pages fit the pool (and one segment).
  for (int64_t k = 0; k < T && !all_fit; ++k) {
    const int64_t b = tensor_base(g, s, k);
    const int64_t end = detail::checked_add(b, extent, "KV layout extent");
    MOEBIUS_CHECK(end <= l.pool_bytes, errc::invalid_argument, "kv_pool_layout ", v,
                  " view: ", tensor_name{g, k}, " ends at byte ", end, " beyond pool_bytes ",
                  l.pool_bytes, " (base ", b, ", ", N, " pages at stride ", s.page, ")");
    if (l.segment_bytes > 0) {
      MOEBIUS_CHECK(b / l.segment_bytes == (end - 1) / l.segment_bytes, errc::invalid_argument,
                    "kv_pool_layout ", v, " view: ", tensor_name{g, k}, " (bytes [", b, ", ", end,
                    ")) crosses an allocation boundary (segment_bytes ", l.segment_bytes,
                    "): each tensor must lie in one allocation");
    }
  }
  // No two tensors' pages overlap: pieces b_k + p*S and b_k' + p'*S (length pb) meet iff some
  // m = p' - p in [-(N-1), N-1] has |(b_k - b_k') - m*S| < pb; the distance is convex in m, so
  // the nearest two m (clamped) decide.
  // Only tensors whose byte ranges [base, base + (N-1) S + pb) intersect can meet: sweep them in
  // order of base (O(T log T) for layouts whose tensors lie apart, the present one among them;
  // interleaved ones, K and V side by side, compare only the pairs that interleave).
  if (apart) return;
  // Layers that lie apart (ascending, each layer's last tensor ending before the next layer
  // starts) meet only within a layer, and every layer is layer 0 moved by the layer stride:
  // layer 0's tensors decide (K and V side by side, as vLLM's FlashInfer layout puts them).
  const bool layers_apart = ascending && (g.num_layers == 1 || across >= extent);
  const int64_t swept = layers_apart ? kvt : T;
  std::vector<int64_t> order(static_cast<size_t>(swept));
  for (int64_t k = 0; k < swept; ++k) order[static_cast<size_t>(k)] = k;
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return tensor_base(g, s, x) < tensor_base(g, s, y);
  });
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t a = order[i];
    for (size_t j = i + 1;
         j < order.size() && tensor_base(g, s, order[j]) < tensor_base(g, s, a) + extent; ++j) {
      const int64_t c = order[j];
      const int64_t d = tensor_base(g, s, a) - tensor_base(g, s, c);
      int64_t cand[2] = {0, 0};
      if (s.page > 0 && N > 1) {
        cand[0] = std::clamp<int64_t>(floor_div(d, s.page), -(N - 1), N - 1);
        cand[1] = std::clamp<int64_t>(floor_div(d, s.page) + 1, -(N - 1), N - 1);
      }
      for (int64_t mm : cand) {
        const int64_t dist = d - mm * s.page;  // (piece a, page p) - (piece c, page p + mm)
        if (dist > -pb && dist < pb) {
          const int64_t pa = mm >= 0 ? 0 : -mm, pc = pa + mm;
          const int64_t sa = tensor_base(g, s, a) + pa * s.page;
          const int64_t sc = tensor_base(g, s, c) + pc * s.page;
          MOEBIUS_FAIL(errc::invalid_argument, "kv_pool_layout ", v, " view: ", tensor_name{g, a},
                       " page ", pa, " (bytes [", sa, ", ", sa + pb, ")) and ", tensor_name{g, c},
                       " page ", pc, " (bytes [", sc, ", ", sc + pb, ")) overlap");
        }
      }
    }
  }
}

// TP page j of tensor k; k = -1: none.
struct tp_page_ref {
  int64_t k = -1, j = -1;
};

// The first TP page 0..split-1 of tensors [0, tensors) not inside the union of those tensors'
// EP pages 0, or none.
tp_page_ref first_tp_page_outside_ep(const kv_geometry& g, const kv_pool_layout& l,
                                     int64_t tensors) {
  const int64_t split = g.tp_pages_per_ep_page();
  const int64_t epb = g.ep_page_bytes(), tpb = g.tp_page_bytes();
  std::vector<std::pair<int64_t, int64_t>> ep_runs;
  ep_runs.reserve(static_cast<size_t>(tensors));
  for (int64_t k = 0; k < tensors; ++k) {
    const int64_t b = tensor_base(g, l.ep, k);
    ep_runs.emplace_back(b, b + epb);
  }
  std::sort(ep_runs.begin(), ep_runs.end());
  std::vector<std::pair<int64_t, int64_t>> merged;
  for (const auto& r : ep_runs) {
    if (!merged.empty() && r.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, r.second);
    else
      merged.push_back(r);
  }
  for (int64_t k = 0; k < tensors; ++k) {
    for (int64_t j = 0; j < split; ++j) {
      const int64_t b = tensor_base(g, l.tp, k) + j * l.tp.page;
      auto it = std::upper_bound(merged.begin(), merged.end(), std::make_pair(b, INT64_MAX));
      const bool inside =
          it != merged.begin() && std::prev(it)->first <= b && b + tpb <= std::prev(it)->second;
      if (!inside) return {k, j};
    }
  }
  return {};
}

}  // namespace

kv_strides derive_tp_strides(const kv_geometry& g, const kv_strides& ep) {
  const int64_t split = g.tp_pages_per_ep_page();
  if (split == 1) return ep;
  // TP's split pages tile one EP page, so the page stride must cover an EP page's bytes even
  // when the pool has one EP page (where the EP view alone never steps by it). Below that,
  // every stride inside the page would be taken for one outside it.
  MOEBIUS_CHECK(g.num_ep_pages == 0 || ep.page >= g.ep_page_bytes(), errc::invalid_argument,
                "kv_pool_layout: the EP page stride ", ep.page, " is smaller than an EP page (",
                g.ep_page_bytes(), " bytes); TP's ", split,
                " pages tile an EP page, so the stride must cover one, even with one EP page");
  kv_strides tp = ep;
  // Inside a page and outside a head: the engine's TP shape has split x the pages of 1/split the
  // heads, so these strides (products of sizes that include the head count) shrink by split.
  // Strictly inside: a stride equal to the page stride is a dimension outside the page (K -> V
  // or layer -> layer with one page per tensor).
  auto shrink = [&](int64_t& s, const char* what) {
    if (s > ep.head && s < ep.page) {
      MOEBIUS_CHECK(s % split == 0, errc::invalid_argument, "kv_pool_layout: the EP ", what,
                    " stride ", s, " lies inside a page, so the TP view divides it by split ",
                    split, ", which does not divide it");
      s /= split;
    }
  };
  shrink(tp.layer, "layer");
  if (!g.latent()) shrink(tp.kv, "K|V");
  shrink(tp.token, "token");
  MOEBIUS_CHECK(ep.page % split == 0, errc::invalid_argument, "kv_pool_layout: the EP page stride ",
                ep.page, " must be a multiple of split ", split,
                " (TP has split x the pages in the same bytes)");
  tp.page = ep.page / split;
  return tp;
}

void validate(const kv_geometry& g, const kv_pool_layout& l) {
  validate(g);
  detail::check_enum(l.preset, "kv_pool_layout preset (kv_preset)");
  MOEBIUS_CHECK(l.pool_bytes >= 0 && l.segment_bytes >= 0, errc::invalid_argument,
                "kv_pool_layout needs pool_bytes >= 0 and segment_bytes >= 0 (pool_bytes=",
                l.pool_bytes, ", segment_bytes=", l.segment_bytes, ")");
  check_view(g, l, parallel_mode::ep);
  const kv_strides want = derive_tp_strides(g, l.ep);
  MOEBIUS_CHECK(l.tp == want, errc::invalid_argument,
                "kv_pool_layout: the TP view must be derived from the EP view (TP ", l.tp,
                ", derived ", want, ")");
  check_view(g, l, parallel_mode::tp);
  // TP pages 0..split-1 tile EP page 0 over all tensors (both are affine in the page with the
  // same step, ep.page = split * tp.page, so page 0 decides for every page). Both views' pieces
  // are disjoint, and the byte totals agree, so containment is equality.
  const int64_t split = g.tp_pages_per_ep_page();
  if (split == 1 || g.num_ep_pages == 0) return;
  const int64_t T = g.num_tensors();
  const int64_t tpb = g.tp_page_bytes();
  // With the same base and layer stride in both views (the present layout, the presets),
  // layer l of either view is layer 0 moved by l * layer stride: TP pages of layer 0 inside
  // layer 0's EP pages hold for every layer, O(kv tensors) at any number of layers. When that
  // does not show it, every tensor decides (O(T log T) time, O(T) memory), with the error.
  const bool layers_translate = l.tp.base == l.ep.base && l.tp.layer == l.ep.layer;
  if (layers_translate && first_tp_page_outside_ep(g, l, g.kv_tensors()).k < 0) return;
  const tp_page_ref bad = first_tp_page_outside_ep(g, l, T);
  if (bad.k < 0) return;
  const int64_t b = tensor_base(g, l.tp, bad.k) + bad.j * l.tp.page;
  MOEBIUS_FAIL(errc::invalid_argument, "kv_pool_layout: TP page ", bad.j, " of ",
               tensor_name{g, bad.k}, " (bytes [", b, ", ", b + tpb,
               ")) is not inside EP page 0's bytes: TP pages p*", split, "..p*", split, "+",
               split - 1, " must occupy exactly EP page p");
}

kv_pool_layout make_kv_pool_layout(const kv_geometry& g, const kv_strides& ep, int64_t pool_bytes,
                                   int64_t segment_bytes, kv_preset preset) {
  validate(g);
  kv_pool_layout l;
  l.ep = ep;
  l.tp = derive_tp_strides(g, ep);
  l.pool_bytes = pool_bytes;
  l.segment_bytes = segment_bytes;
  l.preset = preset;
  validate(g, l);
  return l;
}

namespace {

// Inner strides of a dense page (EP view) in g.layout's order: the present pool's.
kv_strides dense_page(const kv_geometry& g) {
  kv_strides s = g.present_strides(parallel_mode::ep);
  s.kv = s.layer = 0;
  return s;
}

// Pool bytes of L buffers of `layer_bytes` at `layer_stride`.
int64_t extent(const kv_geometry& g, int64_t layer_stride, int64_t layer_bytes) {
  return detail::checked_add(detail::checked_mul(g.num_layers - 1, layer_stride, "KV pool bytes"),
                             layer_bytes, "KV pool bytes");
}

}  // namespace

kv_pool_layout present_kv_layout(const kv_geometry& g) {
  validate(g);
  return make_kv_pool_layout(g, g.present_strides(parallel_mode::ep), g.pool_bytes(), 0,
                             kv_preset::present);
}

kv_pool_layout vllm_flash_attn_layout(const kv_geometry& g, const kv_buffer_spacing& sp) {
  validate(g);
  kv_strides s = dense_page(g);
  s.kv = g.region_bytes();  // dimension 0 of (2, num_blocks, ...)
  const int64_t layer_bytes = g.kv_tensors() * g.region_bytes();
  s.layer = sp.layer_stride > 0 ? sp.layer_stride : layer_bytes;
  if (g.latent()) s.kv = 0;  // no V
  return make_kv_pool_layout(g, s, extent(g, s.layer, layer_bytes), sp.segment_bytes,
                             kv_preset::vllm_flash_attn);
}

kv_pool_layout vllm_flashinfer_layout(const kv_geometry& g, const kv_buffer_spacing& sp) {
  validate(g);
  kv_strides s = dense_page(g);
  s.kv = g.ep_page_bytes();                     // dimension 1 of (num_blocks, 2, ...)
  s.page = g.kv_tensors() * g.ep_page_bytes();  // K and V of a block side by side
  const int64_t layer_bytes = g.num_ep_pages * s.page;
  s.layer = sp.layer_stride > 0 ? sp.layer_stride : layer_bytes;
  if (g.latent()) s.kv = 0;
  return make_kv_pool_layout(g, s, extent(g, s.layer, layer_bytes), sp.segment_bytes,
                             kv_preset::vllm_flashinfer);
}

kv_pool_layout sglang_mha_layout(const kv_geometry& g, const kv_buffer_spacing& sp) {
  validate(g);
  MOEBIUS_CHECK(g.layout == kv_layout::nhd || g.page_size == 1 || g.heads_per_ep_page() == 1,
                errc::invalid_argument,
                "sglang_mha_layout: SGLang's buffers are token-major [tokens, heads, dim]: the "
                "geometry must be NHD (layout=",
                to_string(g.layout), ", page_size=", g.page_size, ")");
  kv_strides s = dense_page(g);
  const int64_t buffer = g.region_bytes();  // [N * page_size, H, D]
  s.kv = sp.kv_stride > 0 ? sp.kv_stride : buffer;
  const int64_t layer_bytes =
      g.latent() ? buffer : detail::checked_add(s.kv, buffer, "sglang_mha_layout layer bytes");
  s.layer = sp.layer_stride > 0 ? sp.layer_stride : g.kv_tensors() * buffer;
  if (g.latent()) s.kv = 0;
  return make_kv_pool_layout(g, s, extent(g, s.layer, layer_bytes), sp.segment_bytes,
                             kv_preset::sglang_mha);
}

kv_pool_layout kv_preset_layout(kv_preset p, const kv_geometry& g) {
  detail::check_enum(p, "kv_preset");
  switch (p) {
    case kv_preset::present:
      return present_kv_layout(g);
    case kv_preset::vllm_flash_attn:
      return vllm_flash_attn_layout(g);
    case kv_preset::vllm_flashinfer:
      return vllm_flashinfer_layout(g);
    case kv_preset::sglang_mha:
      return sglang_mha_layout(g);
    case kv_preset::custom:
      break;
  }
  MOEBIUS_FAIL(errc::invalid_argument, "kv_preset_layout: 'custom' has no preset strides");
}

bool kv_slice_is_block(const kv_geometry& g, const kv_pool_layout& l) {
  if (g.tp_pages_per_ep_page() == 1 || g.page_size == 1) return true;
  return l.ep.head == g.page_size * g.head_bytes() && l.ep.token == g.head_bytes();  // HND
}

bool kv_slices_in_place(const kv_geometry& g, const kv_pool_layout& l) {
  if (!kv_slice_is_block(g, l)) return false;
  if (g.tp_pages_per_ep_page() == 1) return l.tp == l.ep;
  // TP page p*split + j of tensor k at b'_k + (p*split + j) * tp.page must be slice j of EP page
  // p at b_k + p * ep.page + j * tp_page_bytes: the same tensor bases and tp.page = TP page bytes.
  return l.tp.base == l.ep.base && l.tp.layer == l.ep.layer && (g.latent() || l.tp.kv == l.ep.kv) &&
         l.tp.page == g.tp_page_bytes();
}

std::ostream& operator<<(std::ostream& os, const kv_strides& s) {
  return os << "base=" << s.base << " layer=" << s.layer << " kv=" << s.kv << " page=" << s.page
            << " token=" << s.token << " head=" << s.head << " dim=" << s.dim;
}

std::ostream& operator<<(std::ostream& os, const kv_pool_layout& l) {
  return os << "kv_pool_layout{" << to_string(l.preset) << ", EP {" << l.ep << "}, TP {" << l.tp
            << "}, pool_bytes=" << l.pool_bytes << ", segment_bytes=" << l.segment_bytes << '}';
}

}  // namespace moebius
