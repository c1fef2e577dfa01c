#pragma once

// Where a rank's KV bytes lie: the paged KV pool described by a byte stride per dimension, so
// that Moebius migrates the cache an engine already has, in the layout its attention kernels
// read (docs/kv_layouts.md). kv_geometry says WHAT is cached (layers, heads, pages, dtype);
// kv_pool_layout says WHERE each element is:
//
//   offset(m, layer, K|V, page, head, token, dim) = s.base + layer * s.layer + t * s.kv
//       + page * s.page + token * s.token + head * s.head + dim * s.dim,   s = view(m)
//
// in the rank's kv_pool memory space. Both views address the same bytes: the TP view is derived
// from the EP view (derive_tp_strides) the way an engine running TP over the same buffer would
// shape it: num_pages x split pages of H_kv / split heads (replication when H_kv < P and the
// latent case as in kv_geometry.hpp). Every stride that lies inside a page and outside a head
// (the page itself; the token with NHD; K|V when K and V of a page sit side by side) shrinks by
// split, the others stay.
//
// What the planner needs, and validate() checks (each page piece below is one (layer, K|V,
// page) of page_bytes(m) bytes):
//   - a page piece is one dense HND or NHD block (dim stride = element size), so a page is
//     copied as one row and a head slice as one row (HND) or page_size rows (NHD);
//   - no two page pieces overlap, in either view, and all lie inside pool_bytes (and each
//     tensor's pieces inside one segment, when segment_bytes > 0);
//   - TP pages p*split .. p*split+split-1 occupy exactly the bytes of EP page p (over all
//     tensors), so freeing EP page p frees those TP pages: the planner's page accounting.
// The owner's head slice stays in place on EP->TP exactly when slice j of EP page p IS TP page
// p*split + j (kv_slices_in_place): the present HND layout, vLLM FlashAttention HND. Other
// layouts migrate through whole free pages, as NHD does today.
//
// Presets (docs/kv_layouts.md has the sources), L layers, N pages of page_size tokens, pb =
// one page of one tensor in bytes:
//   present_kv_layout:       pool [layer][K|V][page]: layer = 2*N*pb, kv = N*pb, page = pb
//   vllm_flash_attn_layout:  per layer (2, num_blocks, block_size, H, D): same as present with
//                            layer = layer_stride (tensors of one buffer, or segments)
//   vllm_flashinfer_layout:  per layer (num_blocks, 2, block_size, H, D): page = 2*pb, kv = pb
//                            (K and V of a block side by side)
//   sglang_mha_layout:       k_buffer[l], v_buffer[l] = [tokens, H, D] (NHD; page = page_size
//                            consecutive token slots), buffers anywhere at uniform spacing
// HND/NHD of the geometry picks the page's inner order (vLLM's stride order (0,1,3,2,4) = HND).
//
// Trivially copyable: kernels and transports may take it by value.

#include <cstdint>
#include <iosfwd>

#include "moebius/detail/host_device.hpp"
#include "moebius/kv/kv_geometry.hpp"

namespace moebius {

// Which engine layout a kv_pool_layout was built for (names only: the strides are the truth).
enum class kv_preset : uint8_t {
  present,          // Moebius's own pool (kv_geometry.hpp)
  vllm_flash_attn,  // vLLM v1 FlashAttention backend
  vllm_flashinfer,  // vLLM v1 FlashInfer backend
  sglang_mha,       // SGLang MHATokenToKVPool
  custom,           // strides given by the caller
};

constexpr bool is_valid(kv_preset p) {
  return p == kv_preset::present || p == kv_preset::vllm_flash_attn ||
         p == kv_preset::vllm_flashinfer || p == kv_preset::sglang_mha || p == kv_preset::custom;
}

constexpr const char* to_string(kv_preset p) {
  switch (p) {
    case kv_preset::present:
      return "present";
    case kv_preset::vllm_flash_attn:
      return "vllm_flash_attn";
    case kv_preset::vllm_flashinfer:
      return "vllm_flashinfer";
    case kv_preset::sglang_mha:
      return "sglang_mha";
    case kv_preset::custom:
      return "custom";
  }
  return "unknown";
}

// kv_strides (one view's byte strides and THE offset function) is in kv_geometry.hpp.

struct kv_pool_layout {
  kv_strides ep;           // the EP view
  kv_strides tp;           // the TP view: derive_tp_strides(g, ep)
  int64_t pool_bytes = 0;  // bytes of each rank's kv_pool space the layout addresses
  // 0: the pool is one allocation. > 0: the pool is a list of allocations (one per layer, or per
  // layer and K|V), allocation i at pool offsets [i * segment_bytes, (i+1) * segment_bytes);
  // every tensor's pages then lie inside one allocation, so no copy row crosses one.
  int64_t segment_bytes = 0;
  kv_preset preset = kv_preset::custom;

  MOEBIUS_HOST_DEVICE constexpr const kv_strides& view(parallel_mode m) const {
    return m == parallel_mode::ep ? ep : tp;
  }
  // Same arguments as kv_geometry::offset; kv_strides::offset of the view. The TP view's page
  // is the rank's own page id: with dcp > 1, kv_view maps a sequence's token to it.
  MOEBIUS_HOST_DEVICE constexpr int64_t offset(parallel_mode m, int64_t layer, kv_tensor t,
                                               int64_t page, int64_t head, int64_t token,
                                               int64_t dim) const {
    return view(m).offset(layer, t, page, head, token, dim);
  }
  friend constexpr bool operator==(const kv_pool_layout&, const kv_pool_layout&) = default;
};

// The TP view of EP strides `ep` (see above). Throws errc::invalid_argument when a stride that
// must shrink is not a multiple of split, naming it.
kv_strides derive_tp_strides(const kv_geometry& g, const kv_strides& ep);

// Throws errc::invalid_argument (naming the broken constraint, the view and the values) unless
// validate(g) holds, every stride and base is >= 0 and a multiple of the element size, dim
// stride = element size, each page piece is a dense HND or NHD block, tp == derive_tp_strides,
// no two page pieces overlap in either view, all fit pool_bytes (and one segment each), and TP
// pages p*split.. tile EP page p. O(1) for layouts whose tensors lie apart in ascending order
// (the present one), O(kv tensors) when only K and V of a layer interleave (vLLM FlashInfer);
// otherwise O(tensors log tensors) time and O(tensors) memory, O(tensors^2) at worst for
// tensors that all interleave.
void validate(const kv_geometry& g, const kv_pool_layout& l);

// A layout from EP strides (TP derived), validated.
kv_pool_layout make_kv_pool_layout(const kv_geometry& g, const kv_strides& ep, int64_t pool_bytes,
                                   int64_t segment_bytes = 0, kv_preset preset = kv_preset::custom);

// Today's pool: offset() equals g.offset() for every element (the planner's default).
kv_pool_layout present_kv_layout(const kv_geometry& g);

// How an engine's per-layer buffers sit in the pool space. 0 = packed back to back (then the
// layout needs one allocation holding them all, or segment_bytes = the packed size).
struct kv_buffer_spacing {
  int64_t layer_stride = 0;   // bytes from layer l's buffer(s) to layer l+1's
  int64_t kv_stride = 0;      // SGLang: bytes from layer l's K buffer to its V buffer
  int64_t segment_bytes = 0;  // kv_pool_layout::segment_bytes
};

// vLLM v1 FlashAttention, per layer a tensor (2, num_blocks = N, block_size, H_kv, head_size),
// stride order identity (NHD) or (0,1,3,2,4) (HND) as g.layout says; latent (MLA): per layer
// (num_blocks, block_size, D). Layer l's tensor at l * layer_stride (packed: 2 * N * pb).
kv_pool_layout vllm_flash_attn_layout(const kv_geometry& g, const kv_buffer_spacing& sp = {});
// vLLM v1 FlashInfer, per layer (num_blocks, 2, block_size, H_kv, head_size), HND by stride
// order (0,1,3,2,4); latent as above.
kv_pool_layout vllm_flashinfer_layout(const kv_geometry& g, const kv_buffer_spacing& sp = {});
// SGLang MHATokenToKVPool: k_buffer[l], v_buffer[l] each [N * page_size, H_kv, D] (token slot =
// page * page_size + token; g.layout must be NHD: the buffers are token-major); MLATokenToKVPool
// (latent): kv_buffer[l] = [N * page_size, 1, D]. K of layer l at l * layer_stride, its V at
// + kv_stride (packed: kv_stride = N * pb, layer_stride = 2 * N * pb).
kv_pool_layout sglang_mha_layout(const kv_geometry& g, const kv_buffer_spacing& sp = {});

// The preset's layout for `g` with packed buffers (present: present_kv_layout).
kv_pool_layout kv_preset_layout(kv_preset p, const kv_geometry& g);

// Whether head slice j of EP page p is exactly TP page p*split + j, for every tensor (bytes and
// order): then EP->TP keeps the owner's slice in place and pieces move one by one.
bool kv_slices_in_place(const kv_geometry& g, const kv_pool_layout& l);
// Whether a head slice of an EP page piece is one contiguous block (HND, page_size 1, or an
// unsplit page); otherwise it is page_size rows (NHD).
bool kv_slice_is_block(const kv_geometry& g, const kv_pool_layout& l);

std::ostream& operator<<(std::ostream& os, const kv_strides& s);
std::ostream& operator<<(std::ostream& os, const kv_pool_layout& l);

}  // namespace moebius
