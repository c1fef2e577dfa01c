#pragma once

// The scaffolding of the GPU runtime's tests (test_gpu_runtime.cu, test_gpu_runtime_virtual.cu,
// test_gpu_runtime_dcp.cu): the tiny model and its runtime options (on virtual ranks too), a
// serving loop that switches modes (stop-the-world, progressive, or with the copies beside the
// steps), the checks of its logits against the float64 reference and of two runs against each
// other, and the runtime's memory poisoned or read back.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <moebius/memory/rank_memory.hpp>
#include <moebius/switch/switcher.hpp>
#include <optional>
#include <span>
#include <sstream>
#include <vector>

#include "gpu_runtime.hpp"
#include "runtime_test_model.hpp"
#include "step_beside.hpp"
#include "tests/catch.hpp"

namespace mini_engine::gpu::testing {

inline int test_ranks() {
  int n = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&n));
  return n >= 2 ? 2 : 1;
}

inline model_config tiny_config(moebius::dtype t) {
  model_config c;  // L=2, H=64, Hq=4, Hkv=2, D=16, E=8, top-2, I=32, V=256
  c.num_layers = 3;
  c.page_size = 4;
  c.expert_dtype = t;
  c.kv_dtype = t;
  return c;
}

// fp8 experts (blocks of 8: whole blocks in every TP slice at P <= 2, I/P = 16) dequantized to
// `compute`; KV in `compute` too.
inline model_config tiny_fp8_config(moebius::dtype compute) {
  model_config c = tiny_config(compute);
  c.expert_dtype = moebius::dtype::fp8_e4m3;
  c.fp8_block = 8;
  return c;
}

// The dtype the expert GEMMs run in: the expert dtype, or for fp8 the KV's (tiny_fp8_config).
inline moebius::dtype compute_dtype(const model_config& c) {
  return c.expert_dtype == moebius::dtype::fp8_e4m3 ? c.kv_dtype : c.expert_dtype;
}

inline gpu_runtime_options tiny_options(int P, moebius::arena_cursor cursor, moebius::dtype dense) {
  gpu_runtime_options o = options_from_env();
  o.num_ranks = P;
  o.num_ep_pages = 64;
  o.max_pages_per_seq = 16;
  o.max_tokens = 32;
  o.buckets = {1, 2, 4, 8};
  o.cursor = cursor;
  o.dense_dtype = dense;
  o.fp8_compute_dtype = dense;
  o.slot_alignment = 4096;
  return o;
}

// Graphs captured at construction with tiny_options: whole-model (EP + TP at each serve dcp)
// x 4 buckets, and per-layer (hybrid steps) the same x L.
inline int64_t expected_captures(const gpu_runtime& rt, const model_config& c) {
  if (!rt.graphs_enabled()) return 0;
  const int64_t modes = 1 + static_cast<int64_t>(rt.serve_dcps().size());
  return 4 * modes * (1 + (rt.hybrid_graphs_enabled() ? c.num_layers : 0));
}

struct serve_result {
  std::vector<std::vector<int32_t>> seqs;               // prompt + generated, per sequence
  std::vector<std::vector<std::vector<float>>> logits;  // per sequence, per sampled step
  std::vector<std::vector<int64_t>> positions;          // position of each sampled row
  moebius::kv_state tables;  // the page tables after the last step (the switcher's, if any)
};

// Three sequences: seq 0's prompt in two chunks over steps 0 and 1, seqs 1 and 2 whole at step
// 0, then `decode_steps` decode steps of all three. `switch_at[s]` = mode to switch to before
// step s (through the switcher; needs a switcher). `progressive_layers` > 0: each switch is
// progressive instead (switcher begin at step s, then advance(progressive_layers) + poll before
// each step, hybrid steps meanwhile, finish after the step that reaches the last layer); every
// sequence's pages for the whole run are reserved before begin (the tables are frozen).
// `beside` (progressive only): each advance is enqueued beside the step instead of before it
// (step_beside.hpp: its copies run while the step computes, waiting for the step's
// layer events), the loop waits for them after the step; a fault can be injected into one
// advance, whose switch then rolls back and serving goes on in the source mode.
// `dcp_at[s]` = the TP view's dcp to change to before step s (switcher::switch_dcp,
// stop-the-world; needs a switcher): every step then carries the switcher's dcp
// (step_layout::dcp) and its pages are reserved at it.
struct overlap_options {
  int fault_advance = -1;   // inject a transport fault into this advance of the run (0-based)
  int64_t fault_phase = 0;  // at this phase of it
  int advances = 0;         // out: advances enqueued beside steps
  int rolled_back = 0;      // out: switches that rolled back
};

inline serve_result serve(gpu_runtime& rt, moebius::kv_state tables, moebius::arena_cursor cursor,
                          int decode_steps, const std::map<int, moebius::parallel_mode>& switch_at,
                          moebius::switcher* sw, int64_t progressive_layers = 0,
                          const std::function<void(moebius::arena_cursor)>& after_move = {},
                          overlap_options* beside = nullptr,
                          const std::map<int, int64_t>& dcp_at = {}) {
  const std::vector<std::vector<int32_t>> prompts = {{5, 17, 200, 3, 9, 77, 1}, {42, 8, 13}, {99}};
  const int P = rt.num_ranks();
  serve_result out;
  out.seqs = prompts;
  out.logits.resize(3);
  out.positions.resize(3);
  std::vector<int64_t> done(3, 0);  // tokens of each sequence already in the KV cache
  // Tokens reserved per sequence so far (a progressive switch reserves ahead; the tables
  // never shrink a sequence below what it holds).
  std::vector<int64_t> reserved(3, 0);
  const int total_steps = 2 + decode_steps;
  std::optional<moebius::progressive_switch> session;
  for (int s = 0; s < total_steps; ++s) {
    if (auto it = switch_at.find(s); it != switch_at.end()) {
      REQUIRE(sw != nullptr);
      REQUIRE(!sw->in_progress());
      if (progressive_layers > 0) {
        for (int q = 0; q < 3; ++q) {  // the longest any sequence gets: prompt + one per step
          reserved[static_cast<size_t>(q)] =
              static_cast<int64_t>(prompts[static_cast<size_t>(q)].size()) + total_steps;
          reserve_tokens(moebius::with_dcp(rt.kv(), sw->dcp()), sw->mutable_kv_tables(), q,
                         reserved[static_cast<size_t>(q)], q % P);
        }
        session.emplace(sw->begin(it->second));
        INFO(session->report());
        if (beside != nullptr && beside->rolled_back > 0 &&
            session->report().outcome == moebius::switch_outcome::already_there) {
          session.reset();  // the switch before rolled back: the engine already rests there
        } else {
          REQUIRE(session->open());
        }
      } else {
        const moebius::switch_report rep = sw->switch_to(it->second);
        INFO(rep);
        REQUIRE(rep.outcome == moebius::switch_outcome::committed);
        if (after_move) after_move(sw->cursor());
      }
    }
    if (auto it = dcp_at.find(s); it != dcp_at.end()) {
      REQUIRE(sw != nullptr);
      REQUIRE(!sw->in_progress());
      const moebius::switch_report rep = sw->switch_dcp(it->second);
      INFO(rep);
      REQUIRE(rep.outcome == moebius::switch_outcome::committed);
      REQUIRE(sw->dcp() == it->second);
    }
    // The geometry the step's tables are at: the switcher's dcp (a dcp change moves it).
    const moebius::kv_geometry geometry =
        sw != nullptr ? moebius::with_dcp(rt.kv(), sw->dcp()) : rt.kv();
    const bool hybrid = session.has_value();
    if (hybrid && beside == nullptr) {
      session->advance(progressive_layers);
      // Blocks on the advance's copies (no spin on poll()).
      const moebius::progress_state state = session->wait();
      REQUIRE(state == moebius::progress_state::ready);  // the advance committed its layers
      if (after_move) after_move(session->view().cursor());
    }
    // Frozen tables during a progressive switch: read-only, through the session's view.
    const moebius::kv_state& kv = hybrid ? session->view().tables(session->view().source())
                                  : sw != nullptr ? sw->mutable_kv_tables()
                                                  : tables;
    const moebius::arena_cursor cur = sw != nullptr ? sw->cursor() : cursor;
    std::vector<step_item> items;
    std::vector<std::vector<int32_t>> chunk_store(3);
    std::vector<int> item_seq;
    for (int q = 0; q < 3; ++q) {
      const auto& toks = out.seqs[static_cast<size_t>(q)];
      int64_t from = done[static_cast<size_t>(q)], to = static_cast<int64_t>(toks.size());
      if (s == 0 && q == 0) to = 4;    // first chunk of seq 0
      if (s == 1 && q != 0) continue;  // seqs 1, 2 wait for seq 0's second chunk
      if (from >= to) continue;
      chunk_store[static_cast<size_t>(q)].assign(toks.begin() + from, toks.begin() + to);
      if (!hybrid) {
        reserved[static_cast<size_t>(q)] = std::max(reserved[static_cast<size_t>(q)], to);
        reserve_tokens(geometry, sw != nullptr ? sw->mutable_kv_tables() : tables, q,
                       reserved[static_cast<size_t>(q)], q % P);
      }
      step_item it;
      it.seq_id = q;
      it.tokens = chunk_store[static_cast<size_t>(q)];
      it.start_position = from;
      it.sample = to == static_cast<int64_t>(toks.size());
      items.push_back(it);
      item_seq.push_back(q);
    }
    moebius::validate(geometry, kv);
    std::vector<std::vector<float>> logits;
    step_layout layout = hybrid ? step_layout::during(session->view()) : step_layout{&kv, cur};
    if (sw != nullptr) layout.dcp = sw->dcp();
    std::vector<int32_t> next;
    if (hybrid && beside != nullptr) {
      const auto advance = [&](const moebius::step_layer_events* events) {
        REQUIRE(events != nullptr);  // a hybrid step hands out its layer events
        if (beside->advances++ == beside->fault_advance)
          sw->inject_fault(moebius::switch_fault{moebius::switch_fault::stage::weights,
                                                 moebius::fault_point{beside->fault_phase, 0}});
        session->advance(progressive_layers, {}, events);
      };
      const auto settle = [&]() -> step_layout {
        session->wait();
        if (!session->open()) return step_layout{&sw->kv_tables(), sw->cursor()};
        return step_layout::during(session->view());
      };
      next = step_beside(rt, layout, items, advance, settle, &logits).step.tokens;
      session->wait();
      if (!session->open()) {  // the advance failed: everything moved is back
        INFO(session->report());
        REQUIRE(session->report().outcome == moebius::switch_outcome::rolled_back);
        ++beside->rolled_back;
        session.reset();
        if (after_move) after_move(sw->cursor());
      } else if (after_move) {
        after_move(session->view().cursor());
      }
    } else {
      next = rt.step(layout, items, &logits);
    }
    size_t li = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      const int q = item_seq[i];
      done[static_cast<size_t>(q)] =
          items[i].start_position + static_cast<int64_t>(items[i].tokens.size());
      if (!items[i].sample) {
        REQUIRE(next[i] == -1);
        continue;
      }
      out.positions[static_cast<size_t>(q)].push_back(done[static_cast<size_t>(q)] - 1);
      out.logits[static_cast<size_t>(q)].push_back(logits[li++]);
      out.seqs[static_cast<size_t>(q)].push_back(next[i]);
    }
    REQUIRE(li == logits.size());
    if (hybrid && session && session->layers_remaining() == 0) {
      const moebius::switch_report rep = session->finish();
      session.reset();
      INFO(rep);
      REQUIRE(rep.outcome == moebius::switch_outcome::committed);
      if (after_move) after_move(sw->cursor());
    }
  }
  if (sw != nullptr) REQUIRE(!sw->in_progress());
  out.tables = sw != nullptr ? sw->kv_tables() : tables;
  return out;
}

// Every sampled row against the float64 reference of the generated sequence (teacher-forced
// with the runtime's own tokens), and each sampled token the argmax of its row.
// fp32: every logit within atol + rtol |want|. bf16 (weights rounded to bf16, so only the
// activations' rounding at GEMM inputs and the KV differ): the router then sees logits off by
// ~1e-3, so a near-tie between the k-th and (k+1)-th expert can pick another expert than the
// reference for some token and layer, which moves that row by tens of percent. So bf16 checks
// each row's relative RMS error: at most a quarter of the rows above 3% (one flip moves the
// flipped token's row and, through its K/V, a few later ones), none above 60%.
inline void check_against_reference(const model_config& c, const test_weights& w,
                                    const serve_result& r, bool bf16) {
  int64_t rows = 0, loose_rows = 0;
  for (size_t q = 0; q < r.seqs.size(); ++q) {
    const auto ref = reference_logits(c, w, r.seqs[q]);
    for (size_t k = 0; k < r.logits[q].size(); ++k) {
      const auto& got = r.logits[q][k];
      const auto& want = ref[static_cast<size_t>(r.positions[q][k])];
      int64_t bad = 0;
      double worst = 0, err2 = 0, norm2 = 0;
      for (size_t v = 0; v < got.size(); ++v) {
        const double err = std::fabs(got[v] - want[v]);
        worst = std::max(worst, err);
        err2 += err * err;
        norm2 += want[v] * want[v];
        if (!(err <= 2e-3 + 2e-3 * std::fabs(want[v]))) ++bad;
      }
      const double rel_rms = std::sqrt(err2 / norm2);
      INFO("sequence " << q << " sample " << k << " position " << r.positions[q][k]
                       << " worst |err| " << worst << " relative RMS error " << rel_rms);
      ++rows;
      if (bf16) {
        REQUIRE(rel_rms < 0.6);
        if (rel_rms > 0.03) ++loose_rows;
      } else {
        REQUIRE(bad == 0);
      }
      const auto best = std::max_element(got.begin(), got.end()) - got.begin();
      REQUIRE(r.seqs[q][static_cast<size_t>(r.positions[q][k] + 1)] == best);
    }
  }
  INFO(loose_rows << " of " << rows << " rows above 3% relative RMS error");
  REQUIRE(loose_rows * 4 <= rows);
}

// tiny_options with all P ranks on device 0 (collectives over device memory).
inline gpu_runtime_options virtual_options(int P, moebius::arena_cursor cursor,
                                           moebius::dtype t) {
  gpu_runtime_options o = tiny_options(P, cursor, t);
  o.placement = rank_placement::virtual_ranks;
  return o;
}

// Every rank's KV pool set to 0xff bytes (NaN in fp32 and bf16): a step that reads a position
// nobody wrote, or a page a switch forgot, turns its logits into NaN.
inline void poison_kv(const gpu_runtime& rt) {
  for (const moebius::rank_memory& m : rt.memory()) {
    const moebius::memory_span& kv = m.space(moebius::memory_space::kv_pool);
    MOEBIUS_CUDA_CHECK(cudaSetDevice(m.device));
    MOEBIUS_CUDA_CHECK(cudaMemset(kv.base, 0xff, static_cast<size_t>(kv.bytes)));
  }
  MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
}

// Each rank's arena, read back, against the static placement at `cursor` (layers below it in
// TP slot l, the rest in EP slot l + 1: place_layer_experts_in_slot), byte for byte over every
// byte that placement writes. Which bytes it writes: the placement done twice, over slot
// images of 0x00 and of 0xff; where the two agree it wrote (slot padding, which no placement
// writes, may hold anything after a switch).
inline void check_arena(const gpu_runtime& rt, const test_weights& w,
                        moebius::arena_cursor cursor) {
  const moebius::arena_geometry& g = rt.arena();
  const size_t P = static_cast<size_t>(rt.num_ranks()), slot = static_cast<size_t>(g.slot_bytes);
  const std::vector<moebius::rank_memory> mem = rt.memory();
  MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
  for (int64_t l = 0; l < w.config.num_layers; ++l) {
    const moebius::parallel_mode m = moebius::arena_geometry::mode_of(cursor, l);
    std::vector<std::vector<std::byte>> lo(P, std::vector<std::byte>(slot, std::byte{0x00}));
    std::vector<std::vector<std::byte>> hi(P, std::vector<std::byte>(slot, std::byte{0xff}));
    std::vector<std::span<std::byte>> lo_s(lo.begin(), lo.end()), hi_s(hi.begin(), hi.end());
    place_layer_experts_in_slot(w, g, l, m, lo_s);
    place_layer_experts_in_slot(w, g, l, m, hi_s);
    const int64_t at = g.slot_offset(moebius::arena_geometry::slot_of(m, l));
    for (size_t r = 0; r < P; ++r) {
      std::vector<std::byte> got(slot);
      const std::byte* arena = mem[r].space(moebius::memory_space::arena).data();
      MOEBIUS_CUDA_CHECK(cudaMemcpy(got.data(), arena + at, slot, cudaMemcpyDeviceToHost));
      int64_t written = 0, bad = 0;
      for (size_t i = 0; i < slot; ++i) {
        if (lo[r][i] != hi[r][i]) continue;
        ++written;
        bad += got[i] != lo[r][i];
      }
      INFO("cursor " << cursor.tp_layers << " layer " << l << " (" << moebius::to_string(m)
                     << ") rank " << r << ": " << bad << " of " << written
                     << " placed bytes differ");
      REQUIRE(written > 0);
      REQUIRE(bad == 0);
    }
  }
}

// The same greedy tokens, or the first divergence with both runs' logits of their tokens.
// bf16: the activations' rounding at GEMM inputs can flip a near-tie of the router against
// another rank count or mode (check_against_reference's reasoning), which changes that token;
// so for bf16 a divergence is reported (WARN) and the float64 model's bounds are what fails.
inline void require_same_tokens(const serve_result& base, const serve_result& got,
                                const char* what, bool bf16 = false) {
  REQUIRE(base.seqs.size() == got.seqs.size());
  for (size_t q = 0; q < base.seqs.size(); ++q) {
    REQUIRE(base.seqs[q].size() == got.seqs[q].size());
    for (size_t i = 0; i < base.seqs[q].size(); ++i) {
      if (base.seqs[q][i] == got.seqs[q][i]) continue;
      const size_t k = i - (base.seqs[q].size() - base.logits[q].size());
      std::ostringstream why;
      why << "sequence " << q << " token " << i << ": static " << base.seqs[q][i] << " (logit "
          << base.logits[q][k][static_cast<size_t>(base.seqs[q][i])] << "), " << what << " "
          << got.seqs[q][i] << " (logit "
          << got.logits[q][k][static_cast<size_t>(got.seqs[q][i])] << ")";
      if (!bf16) FAIL(why.str());
      WARN("bf16, not a failure: " << why.str());
      break;
    }
  }
}

// Every logit within atol + rtol |base| (every one finite).
inline void require_close_logits(const serve_result& base, const serve_result& got,
                                 double tol) {
  REQUIRE(base.logits.size() == got.logits.size());
  for (size_t q = 0; q < base.logits.size(); ++q) {
    REQUIRE(base.logits[q].size() == got.logits[q].size());
    for (size_t k = 0; k < base.logits[q].size(); ++k) {
      int64_t bad = 0;
      for (size_t v = 0; v < base.logits[q][k].size(); ++v)
        bad += !(std::fabs(got.logits[q][k][v] - base.logits[q][k][v]) <=
                 tol + tol * std::fabs(base.logits[q][k][v]));
      INFO("sequence " << q << " sample " << k << ": " << bad << " logits off");
      REQUIRE(bad == 0);
    }
  }
}

}  // namespace mini_engine::gpu::testing
