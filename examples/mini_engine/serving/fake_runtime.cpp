#include "fake_runtime.hpp"

#include <cstring>

#include <moebius/error.hpp>

namespace mini_engine {

using moebius::errc;
using moebius::kv_sequence;
using moebius::parallel_mode;

namespace {

const kv_sequence* find(const moebius::kv_state& s, int rank, int64_t id) {
  for (const kv_sequence& q : s.ranks[static_cast<size_t>(rank)].sequences) {
    if (q.seq_id == id) return &q;
  }
  return nullptr;
}

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdULL;
}

float fingerprint(int32_t token, int64_t position, int64_t layer, int64_t head) {
  const uint64_t h = mix(mix(mix(static_cast<uint64_t>(token), static_cast<uint64_t>(position)),
                             static_cast<uint64_t>(layer)),
                         static_cast<uint64_t>(head));
  return static_cast<float>(h % 1000003);  // exact in fp32
}

}  // namespace

fake_runtime::fake_runtime(const moebius::arena_geometry& arena, const moebius::kv_geometry& kv,
                           int32_t vocab)
    : arena_(arena), kv_(kv), vocab_(vocab) {
  MOEBIUS_CHECK(kv.type == moebius::dtype::fp32 && kv.num_kv_heads >= 1 &&
                    arena.num_ranks == kv.num_ranks && vocab >= 1,
                errc::invalid_argument,
                "fake_runtime: needs fp32 KV with heads, equal rank counts and vocab >= 1");
  arenas_.assign(static_cast<size_t>(kv.num_ranks),
                 std::vector<std::byte>(static_cast<size_t>(arena.total_bytes())));
  pools_.assign(static_cast<size_t>(kv.num_ranks),
                std::vector<std::byte>(static_cast<size_t>(kv.pool_bytes())));
}

std::vector<moebius::rank_memory> fake_runtime::memory() {
  std::vector<moebius::rank_memory> out;
  for (size_t r = 0; r < arenas_.size(); ++r) out.push_back(moebius::rank_memory::host(arenas_[r], pools_[r]));
  return out;
}

float* fake_runtime::k_at(int rank, parallel_mode m, int64_t layer, int64_t page,
                          int64_t head_in_page, int64_t token_in_page) {
  const int64_t off = kv_.offset(m, layer, moebius::kv_tensor::k, page, head_in_page, token_in_page, 0);
  return reinterpret_cast<float*>(pools_[static_cast<size_t>(rank)].data() + off);
}

std::vector<int32_t> fake_runtime::compute(const step_layout& layout,
                                           std::span<const step_item> items,
                                           std::vector<std::vector<float>>* logits) {
  MOEBIUS_CHECK(!layout.hybrid() && layout.tables != nullptr, moebius::errc::invalid_argument,
                "fake_runtime: hybrid steps (a progressive switch) are not supported; serve "
                "progressive switches on host_runtime");
  const moebius::kv_state& s = *layout.tables;
  const parallel_mode m = s.mode;
  const int P = kv_.num_ranks;
  const int64_t H = kv_.num_kv_heads, ps = kv_.page_size;
  const int64_t per_page = m == parallel_mode::ep ? H : kv_.heads_per_tp_page();
  std::vector<int32_t> out;
  if (logits != nullptr) logits->clear();
  for (const step_item& it : items) {
    // Ranks that hold each head: EP the owner (all heads), TP the ranks of its slice.
    std::vector<const kv_sequence*> held(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) held[static_cast<size_t>(r)] = find(s, r, it.seq_id);
    auto for_head = [&](int64_t head, auto&& fn) {
      for (int r = 0; r < P; ++r) {
        const kv_sequence* q = held[static_cast<size_t>(r)];
        if (q == nullptr) continue;
        if (m == parallel_mode::tp && kv_.tp_slice_of_rank(r) != head / per_page) continue;
        fn(r, *q, m == parallel_mode::ep ? head : head % per_page);
      }
    };
    for (size_t j = 0; j < it.tokens.size(); ++j) {
      const int64_t pos = it.start_position + static_cast<int64_t>(j);
      for (int64_t l = 0; l < kv_.num_layers; ++l) {
        for (int64_t h = 0; h < H; ++h) {
          for_head(h, [&](int r, const kv_sequence& q, int64_t hp) {
            MOEBIUS_CHECK(pos < q.num_tokens, errc::invalid_argument, "fake_runtime: sequence ",
                          it.seq_id, " position ", pos, " beyond its ", q.num_tokens, " tokens");
            *k_at(r, m, l, q.pages[static_cast<size_t>(pos / ps)], hp, pos % ps) =
                fingerprint(it.tokens[j], pos, l, h);
          });
        }
      }
    }
    if (!it.sample) {
      out.push_back(-1);
      continue;
    }
    const int64_t end = it.start_position + static_cast<int64_t>(it.tokens.size());
    uint64_t hash = static_cast<uint64_t>(end);
    for (int64_t l = 0; l < kv_.num_layers; ++l) {
      for (int64_t h = 0; h < H; ++h) {
        float* last = nullptr;
        for (int64_t pos = 0; pos < end; ++pos) {
          for_head(h, [&](int r, const kv_sequence& q, int64_t hp) {
            last = k_at(r, m, l, q.pages[static_cast<size_t>(pos / ps)], hp, pos % ps);
          });
          MOEBIUS_CHECK(last != nullptr, errc::internal, "fake_runtime: no rank holds head ", h,
                        " of sequence ", it.seq_id);
          uint32_t bits = 0;
          std::memcpy(&bits, last, sizeof bits);
          hash = mix(hash, bits);
        }
      }
    }
    const auto token = static_cast<int32_t>(hash % static_cast<uint64_t>(vocab_));
    out.push_back(token);
    if (logits != nullptr) {
      std::vector<float> row(static_cast<size_t>(vocab_), 0.0f);
      row[static_cast<size_t>(token)] = 1.0f;
      logits->push_back(std::move(row));
    }
  }
  return out;
}

}  // namespace mini_engine
