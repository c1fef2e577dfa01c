#pragma once

// The contract between the mini-engine's serving loop and its model runtimes (host and GPU):
// what one forward step is given and what it returns. The serving loop owns the requests,
// the KV page tables (through moebius::switcher) and the schedule; a runtime owns the model's
// weights (experts in the Moebius arena, the rest beside it) and computes.

#include <cstdint>
#include <span>
#include <vector>

#include <moebius/kv/page_table.hpp>
#include <moebius/layout/arena_geometry.hpp>

namespace mini_engine {

// One sequence's work in one step.
struct step_item {
  int64_t seq_id = 0;               // the seq_id of its kv_sequence in the page tables
  std::span<const int32_t> tokens;  // new tokens: a prefill chunk, or the one decode token
  int64_t start_position = 0;       // tokens of this sequence already in the KV cache
  bool sample = false;              // return the next token (last prefill chunk, or decode)
};

// Where the model's layers are: the page tables (their mode) and the arena cursor. Layers
// below the cursor are TP, the rest EP; a static deployment has cursor 0 (EP) or L (TP).
struct step_layout {
  const moebius::kv_state* tables = nullptr;
  moebius::arena_cursor cursor;
};

class runtime {
 public:
  virtual ~runtime() = default;

  // Runs one forward step of every item. Before the call the serving loop has already grown
  // each item's page tables to hold start_position + tokens.size() tokens; the step writes
  // the new tokens' K and V into those pages and attends over all of them. Returns, per item,
  // the greedy next token (-1 for items with sample == false). When `logits` is not null it
  // receives, per sampled item in order, the vocab-sized row of logits.
  virtual std::vector<int32_t> step(const step_layout& layout, std::span<const step_item> items,
                                    std::vector<std::vector<float>>* logits = nullptr) = 0;
};

}  // namespace mini_engine
