#pragma once

// TEMPORARY STAND-IN, not part of the mini-engine: the page bookkeeping API that the model
// helper's examples/mini_engine/kv_pages.hpp provides, with the same signatures, so that the
// serving loop builds and its tests run before that file lands. Only the temporary
// examples/mini_engine/CMakeLists.txt of the serving branch compiles it; delete this folder
// (serving/stub/) when the model helper's kv_pages.hpp/.cpp are merged.

#include <cstdint>

#include <moebius/kv/kv_geometry.hpp>
#include <moebius/kv/page_table.hpp>

namespace mini_engine {

// Grows (or creates) sequence `seq_id` to `num_tokens` tokens: EP on `owner` (an existing
// sequence stays on its owner), TP on every rank. errc::capacity, unchanged, without pages.
void reserve_tokens(const moebius::kv_geometry& g, moebius::kv_state& s, int64_t seq_id,
                    int64_t num_tokens, int owner);
void release_sequence(moebius::kv_state& s, int64_t seq_id);
int64_t free_pages(const moebius::kv_state& s, int rank);
int64_t pages_needed(const moebius::kv_geometry& g, moebius::parallel_mode m, int64_t num_tokens);
int owner_of(const moebius::kv_state& s, int64_t seq_id);  // EP owner or -1

}  // namespace mini_engine
