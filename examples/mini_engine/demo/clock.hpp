#pragma once

// The clock the demo's runs are timed on: priced (an H200 model of the deployment, its decode
// steps from the measured per-rank step curves when there are any) or measured (the host's or
// the GPUs' own time). What each prices is in its description (printed with --verbose).

#include <memory>
#include <string>

#include "options.hpp"
#include "step_clock.hpp"
#include "step_curves.hpp"
#include "world.hpp"

namespace mini_engine::demo {

struct demo_clock {
  std::unique_ptr<h200_step_model> model;  // under a curves clock: outlives it
  std::unique_ptr<step_clock> clock;
  bool priced = false;
  std::string description;  // what it prices and from what, a line or two
  // Simulated: which configurations' step curves are measured and which priced, a line.
  std::string curves_summary;
};

// The priced model of the H200 clock; `run_kv_heads`: the served model's KV heads (they
// matter for the Qwen3-30B-A3B pricing only, where H_kv < P makes TP replicate them).
priced_model priced_of(const options& o, int64_t run_kv_heads);

// EP KV pages per rank an H200 holds for the priced model: 90% of its 141 GB (the rest:
// activations, CUDA graphs, fragmentation) less the rank's EP weights (its 1/P of the experts,
// one spare expert slot, the whole attention and embeddings: Qwen3-235B-A22B at P=8, 73 GB,
// DESIGN.md §7), divided by the priced EP KV bytes of one run token (all L layers, K and V, all
// H_kv heads, times the context scale) and the page size. `why` receives the sum, in words.
//   Qwen3-235B-A22B, P=8, context x32, 16-token pages: (126.9 - 73.2) GB / (192.5 KB x 32 x 16)
//   = 544 pages per rank.
int64_t h200_kv_pages(const priced_model& m, int P, int64_t page_size, std::string* why);

// The clock `o` asks for on world `w` with P ranks.
demo_clock make_clock(const options& o, const world& w, int P);

// "step curves: TP, EP measured (...); TP-DCP2, TEP-DCP2 PRICED, not measured (...)": which of
// `curves`' configurations were measured and which priced; `verbose`: each one's source.
std::string curves_summary(const step_curves& curves, bool verbose);

// The simulated runtime's clock: the region curves of Qwen3-235B-A22B at P = 8 (or --curves
// FILE, --collective-us), TP-DCP2 and TEP-DCP2 priced from TP's where no curve of theirs was
// measured (with_priced_layouts, its DCP exchange at the TP collectives' latency), and the H200
// model (switches, the link, the overlap slowdown) at the run model's KV bytes, contexts as they
// are (scale 1).
demo_clock make_sim_clock(const options& o);

}  // namespace mini_engine::demo
