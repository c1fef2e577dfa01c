#pragma once

// Layout-independent checksums of what a switch must preserve, so that a switch can be
// verified and rolled back when it corrupted something. Each element contributes hash(logical coordinate, value), summed
// modulo 2^64: the sum does not depend on which rank or view holds an element, but moving an
// element to the wrong coordinate, or losing it, changes it. Compare before and after a
// switch. These read host memory (host_transport ranks, or device memory copied back).

#include <cstddef>
#include <cstdint>
#include <span>

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/kv_pool_layout.hpp"
#include "moebius/kv/page_table.hpp"
#include "moebius/layout/arena_geometry.hpp"

namespace moebius {

// Checksum of layer `layer`'s logical expert tensors (w13, w2 and scales) as held by the P
// rank arenas at `cursor` (layer in TP form when layer < cursor.tp_layers, else EP).
uint64_t weight_checksum(const arena_geometry& g, arena_cursor cursor, int64_t layer,
                         std::span<const std::span<const std::byte>> rank_arenas);

// Checksum of every live sequence's K and V (every layer, token, head and dim), read through
// the page tables of `s` from the P rank pools. A head replicated on several TP ranks (H_kv < P)
// counts once, and every replica is read: one that differs from the first changes the sum.
//   H_kv=4, P=8, TP: ranks 0 and 1 both hold head 0; a byte flipped on rank 1 changes it.
uint64_t kv_checksum(const kv_geometry& g, const kv_state& s,
                     std::span<const std::span<const std::byte>> rank_pools);

// The part of kv_checksum that layer `layer` contributes (kv_checksum is the sum over layers,
// modulo 2^64): a per-layer check (switcher_options::verify_layer) of the layer's K and V.
// Throws errc::invalid_argument for a layer outside [0, L), and as kv_checksum.
uint64_t kv_layer_checksum(const kv_geometry& g, const kv_state& s, int64_t layer,
                           std::span<const std::span<const std::byte>> rank_pools);

// The same two over a pool in another layout (kv_pool_layout.hpp; switcher_options::kv_layout):
// the elements are read where `layout` puts them, and the sum is the one the present layout's
// pool holding the same K/V gives. Throws errc::invalid_argument for an invalid layout.
uint64_t kv_checksum(const kv_geometry& g, const kv_pool_layout& layout, const kv_state& s,
                     std::span<const std::span<const std::byte>> rank_pools);
uint64_t kv_layer_checksum(const kv_geometry& g, const kv_pool_layout& layout, const kv_state& s,
                           int64_t layer, std::span<const std::span<const std::byte>> rank_pools);

}  // namespace moebius
