#pragma once

// Where a step's KV pages come from (scheduler::next_step, finish_step): one interface for the
// two cases the serving loop has.
//
//   growing_pages  the switcher's mutable tables: a sequence's tables grow as its tokens are
//                  written, new sequences are admitted, finished ones are released at once;
//   frozen_pages   the tables a progressive switch froze (switcher.hpp): a sequence writes only
//                  the tokens they already hold (reserved before the switch began), nothing is
//                  admitted, and finished sequences' pages are released when the switch has
//                  ended (release_deferred, on the tables then current).

#include <cstdint>
#include <moebius/kv/kv_geometry.hpp>
#include <moebius/kv/page_table.hpp>
#include <vector>

namespace mini_engine {

class page_source {
 public:
  virtual ~page_source() = default;
  // The tables the step reads (their mode is the step's).
  virtual const moebius::kv_state& tables() const = 0;
  // How many of `n` more tokens sequence `id` (with `in_kv` written) may write this step: n
  // when its tables hold them or can grow to (EP: taking pages on `owner`, -1 for its own),
  // else what they hold beyond in_kv (frozen) or 0 (growing: a missing page stalls the whole
  // chunk). Grows the tables when it can.
  virtual int64_t grant(int64_t id, int64_t in_kv, int64_t n, int owner) = 0;
  // Whether new sequences may be admitted.
  virtual bool admits() const = 0;
  // Sequence `id` finished: its pages go back (growing) or wait for the switch to end.
  virtual void release(int64_t id) = 0;
};

class growing_pages final : public page_source {
 public:
  growing_pages(const moebius::kv_geometry& g, moebius::kv_state& tables) : g_(g), kv_(tables) {}
  const moebius::kv_state& tables() const override { return kv_; }
  // The tables themselves, for admission's reservations.
  moebius::kv_state& mutable_tables() { return kv_; }
  int64_t grant(int64_t id, int64_t in_kv, int64_t n, int owner) override;
  bool admits() const override { return true; }
  void release(int64_t id) override;

 private:
  const moebius::kv_geometry& g_;
  moebius::kv_state& kv_;
};

class frozen_pages final : public page_source {
 public:
  // `deferred`: the sequences finished since the switch began (outlives this object: a step's
  // page source is made per step, the list lasts the switch).
  frozen_pages(const moebius::kv_state& tables, std::vector<int64_t>& deferred)
      : kv_(tables), deferred_(deferred) {}
  const moebius::kv_state& tables() const override { return kv_; }
  int64_t grant(int64_t id, int64_t in_kv, int64_t n, int owner) override;
  bool admits() const override { return false; }
  void release(int64_t id) override { deferred_.push_back(id); }

 private:
  const moebius::kv_state& kv_;
  std::vector<int64_t>& deferred_;
};

// Releases the sequences a frozen switch deferred, from `tables` (the tables after it ended),
// and empties the list.
void release_deferred(moebius::kv_state& tables, std::vector<int64_t>& deferred);

// Tokens sequence `id` holds in `kv` (0 when absent): on its EP owner, or on every TP rank.
int64_t held_tokens(const moebius::kv_state& kv, int64_t id);

}  // namespace mini_engine
