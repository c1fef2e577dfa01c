// The GPU runtime end to end: logits against a float64 reference in both modes (and in hybrid
// cursors), TP against EP, CUDA graphs captured once and replayed across switches, and a
// serving run that switches (weights and KV moved by moebius::switcher over
// cuda_peer_transport) giving the same greedy tokens as a run that never switches, hybrid
// steps (progressive switches) replaying per-layer graphs, and those graphs' logits against
// the same hybrid steps run eagerly (bit for bit at P = 1).
// P = 2 when two devices are present, else P = 1 (NCCL allows no two ranks on one device).
// Virtual ranks ([virtual]: P = 2 and 4 on device 0, collectives over device memory): static
// runs against P = 1 and the float64 model, switches (stop-the-world and progressive, through
// cuda_peer_transport on the runtime's memory) against a static run, the arena read back
// after every move against the static placement, no capture after construction.

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <moebius/switch/switcher.hpp>
#include <moebius/transport/cuda_peer_transport.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <vector>

#include "gpu_runtime.hpp"
#include "step_beside.hpp"
#include "runtime_test_model.hpp"
#include "tests/catch.hpp"

using namespace mini_engine;
using namespace mini_engine::gpu;
using namespace mini_engine::gpu::testing;
using moebius::parallel_mode;

namespace {

int test_ranks() {
  int n = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&n));
  return n >= 2 ? 2 : 1;
}

model_config tiny_config(moebius::dtype t) {
  model_config c;  // L=2, H=64, Hq=4, Hkv=2, D=16, E=8, top-2, I=32, V=256
  c.num_layers = 3;
  c.page_size = 4;
  c.expert_dtype = t;
  c.kv_dtype = t;
  return c;
}

// fp8 experts (blocks of 8: whole blocks in every TP slice at P <= 2, I/P = 16) dequantized to
// `compute`; KV in `compute` too.
model_config tiny_fp8_config(moebius::dtype compute) {
  model_config c = tiny_config(compute);
  c.expert_dtype = moebius::dtype::fp8_e4m3;
  c.fp8_block = 8;
  return c;
}

// The dtype the expert GEMMs run in: the expert dtype, or for fp8 the KV's (tiny_fp8_config).
moebius::dtype compute_dtype(const model_config& c) {
  return c.expert_dtype == moebius::dtype::fp8_e4m3 ? c.kv_dtype : c.expert_dtype;
}

gpu_runtime_options tiny_options(int P, moebius::arena_cursor cursor, moebius::dtype dense) {
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

// Graphs captured at construction with tiny_options: whole-model 2 modes x 4 buckets, and
// per-layer (hybrid steps) 2 modes x 4 buckets x L.
int64_t expected_captures(const gpu_runtime& rt, const model_config& c) {
  if (!rt.graphs_enabled()) return 0;
  return 8 + (rt.hybrid_graphs_enabled() ? 8 * c.num_layers : 0);
}

struct serve_result {
  std::vector<std::vector<int32_t>> seqs;               // prompt + generated, per sequence
  std::vector<std::vector<std::vector<float>>> logits;  // per sequence, per sampled step
  std::vector<std::vector<int64_t>> positions;          // position of each sampled row
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
struct overlap_options {
  int fault_advance = -1;   // inject a transport fault into this advance of the run (0-based)
  int64_t fault_phase = 0;  // at this phase of it
  int advances = 0;         // out: advances enqueued beside steps
  int rolled_back = 0;      // out: switches that rolled back
};

serve_result serve(gpu_runtime& rt, moebius::kv_state tables, moebius::arena_cursor cursor,
                   int decode_steps, const std::map<int, parallel_mode>& switch_at,
                   moebius::switcher* sw, int64_t progressive_layers = 0,
                   const std::function<void(moebius::arena_cursor)>& after_move = {},
                   overlap_options* beside = nullptr) {
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
          reserve_tokens(rt.kv(), sw->mutable_kv_tables(), q, reserved[static_cast<size_t>(q)],
                         q % P);
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
        reserve_tokens(rt.kv(), sw != nullptr ? sw->mutable_kv_tables() : tables, q,
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
    moebius::validate(rt.kv(), kv);
    std::vector<std::vector<float>> logits;
    const step_layout layout = hybrid ? step_layout::during(session->view()) : step_layout{&kv, cur};
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
void check_against_reference(const model_config& c, const test_weights& w,
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

}  // namespace

TEST_CASE("gpu_runtime matches the float64 reference in EP, TP and hybrid cursors",
          "[gpu][runtime]") {
  const int P = test_ranks();
  // fp8 experts: dequantized exactly, so fp8 with fp32 compute is held to the fp32 bound and
  // fp8 with bf16 compute to the bf16 one.
  const model_config configs[] = {
      tiny_config(moebius::dtype::fp32), tiny_config(moebius::dtype::bf16),
      tiny_fp8_config(moebius::dtype::fp32), tiny_fp8_config(moebius::dtype::bf16)};
  for (const model_config& c : configs) {
    const moebius::dtype t = compute_dtype(c);
    const bool bf16 = t == moebius::dtype::bf16;
    const test_weights w = make_test_weights(c, seed(21), bf16);
    std::map<std::string, serve_result> results;
    // (attention mode, cursor): the pure modes replay graphs; the hybrids run eagerly.
    const std::pair<parallel_mode, int64_t> cases[] = {{parallel_mode::ep, 0},
                                                       {parallel_mode::tp, c.num_layers},
                                                       {parallel_mode::ep, 1},
                                                       {parallel_mode::tp, 2}};
    for (auto [mode, k] : cases) {
      DYNAMIC_SECTION("experts " << moebius::to_string(c.expert_dtype) << " compute "
                                 << moebius::to_string(t) << " attention " << moebius::to_string(mode)
                               << " cursor " << k) {
        gpu_runtime rt(w, tiny_options(P, {k}, t));
        REQUIRE(rt.captures() == expected_captures(rt, c));
        REQUIRE(rt.graph_statistics().whole_model == (rt.graphs_enabled() ? 8 : 0));
        REQUIRE(rt.graph_statistics().per_layer ==
                rt.captures() - rt.graph_statistics().whole_model);
        const auto r = serve(rt, empty_kv_state(rt.kv(), mode), {k}, 6, {}, nullptr);
        check_against_reference(c, w, r, bf16);
        const bool pure = (mode == parallel_mode::ep && k == 0) ||
                          (mode == parallel_mode::tp && k == c.num_layers);
        if (pure && rt.graphs_enabled())
          REQUIRE(rt.graph_replays() == 6);  // decode steps 2..7 (steps 0, 1 prefill)
        else
          REQUIRE(rt.graph_replays() == 0);
        REQUIRE(rt.captures() == expected_captures(rt, c));
        REQUIRE(rt.hybrid_steps() == 0);
      }
    }
  }
}

TEST_CASE("gpu_runtime: TP and EP logits agree", "[gpu][runtime]") {
  const int P = test_ranks();
  // fp32 experts, and fp8 experts dequantized to fp32 (TP reads each rank's I/P slice of the
  // codes with its scales, EP whole experts: the same weights either way).
  const model_config c = GENERATE(tiny_config(moebius::dtype::fp32),
                                      tiny_fp8_config(moebius::dtype::fp32));
  INFO("experts " << moebius::to_string(c.expert_dtype));
  const test_weights w = make_test_weights(c, seed(22), false);
  gpu_runtime ep(w, tiny_options(P, {0}, moebius::dtype::fp32));
  gpu_runtime tp(w, tiny_options(P, {c.num_layers}, moebius::dtype::fp32));
  const auto a = serve(ep, empty_kv_state(ep.kv(), parallel_mode::ep), {0}, 5, {}, nullptr);
  const auto b =
      serve(tp, empty_kv_state(tp.kv(), parallel_mode::tp), {c.num_layers}, 5, {}, nullptr);
  REQUIRE(a.seqs == b.seqs);
  for (size_t q = 0; q < a.logits.size(); ++q)
    for (size_t k = 0; k < a.logits[q].size(); ++k)
      for (size_t v = 0; v < a.logits[q][k].size(); ++v)
        REQUIRE(std::fabs(a.logits[q][k][v] - b.logits[q][k][v]) <=
                1e-4 + 1e-4 * std::fabs(a.logits[q][k][v]));
}

TEST_CASE("gpu_runtime: switches between steps keep the greedy tokens and never re-capture",
          "[gpu][runtime]") {
  const int P = test_ranks();
  // fp8: the switcher moves the codes and their block scales (the arena's w13_scale / w2_scale).
  const model_config c = GENERATE(tiny_config(moebius::dtype::fp32),
                                      tiny_fp8_config(moebius::dtype::fp32));
  INFO("experts " << moebius::to_string(c.expert_dtype));
  const test_weights w = make_test_weights(c, seed(23), false);
  gpu_runtime static_rt(w, tiny_options(P, {0}, moebius::dtype::fp32));
  const auto base =
      serve(static_rt, empty_kv_state(static_rt.kv(), parallel_mode::ep), {0}, 8, {}, nullptr);

  gpu_runtime rt(w, tiny_options(P, {0}, moebius::dtype::fp32));
  const int64_t captured = rt.captures();
  REQUIRE(captured == expected_captures(rt, c));
  moebius::cuda_peer_transport tr = moebius::cuda_peer_transport::single_process(rt.memory());
  moebius::switcher sw(rt.arena(), rt.kv(), tr, empty_kv_state(rt.kv(), parallel_mode::ep), {0});
  // EP prefill, TP from decode step 3, EP again from 6, TP from 8.
  const std::map<int, parallel_mode> plan = {
      {3, parallel_mode::tp}, {6, parallel_mode::ep}, {8, parallel_mode::tp}};
  const auto switched = serve(rt, {}, {0}, 8, plan, &sw);
  REQUIRE(rt.captures() == captured);
  REQUIRE((rt.graph_replays() > 0 || !rt.graphs_enabled()));
  for (size_t q = 0; q < base.seqs.size(); ++q) {
    for (size_t i = 0; i < base.seqs[q].size(); ++i) {
      if (base.seqs[q][i] == switched.seqs[q][i]) continue;
      // Report the first divergence with the two runs' logit margins at that position.
      std::ostringstream why;
      const size_t k = i - (base.seqs[q].size() - base.logits[q].size());
      const auto& la = base.logits[q][k];
      const auto& lb = switched.logits[q][k];
      why << "sequence " << q << " token " << i << ": static " << base.seqs[q][i] << " (logit "
          << la[static_cast<size_t>(base.seqs[q][i])] << "), switched " << switched.seqs[q][i]
          << " (logit " << lb[static_cast<size_t>(switched.seqs[q][i])] << ")";
      FAIL(why.str());
    }
  }
}

TEST_CASE("gpu_runtime: progressive switches (hybrid steps) keep the greedy tokens and never "
          "re-capture",
          "[gpu][runtime]") {
  const int P = test_ranks();
  const model_config c = GENERATE(tiny_config(moebius::dtype::fp32),  // L = 3
                                      tiny_fp8_config(moebius::dtype::fp32));
  INFO("experts " << moebius::to_string(c.expert_dtype));
  const test_weights w = make_test_weights(c, seed(24), false);
  gpu_runtime static_rt(w, tiny_options(P, {0}, moebius::dtype::fp32));
  const auto base =
      serve(static_rt, empty_kv_state(static_rt.kv(), parallel_mode::ep), {0}, 10, {}, nullptr);

  for (const int64_t layers : {int64_t{1}, int64_t{2}}) {
    INFO("layers per step " << layers);
    gpu_runtime rt(w, tiny_options(P, {0}, moebius::dtype::fp32));
    const int64_t captured = rt.captures();
    moebius::cuda_peer_transport tr = moebius::cuda_peer_transport::single_process(rt.memory());
    moebius::switcher sw(rt.arena(), rt.kv(), tr, empty_kv_state(rt.kv(), parallel_mode::ep),
                         {0});
    // EP -> TP from step 1 (seq 0's second prefill chunk runs hybrid: multi-token rows through
    // the TP -> EP hand-off), TP -> EP from step 6, both a few layers per step.
    const std::map<int, parallel_mode> plan = {{1, parallel_mode::tp}, {6, parallel_mode::ep}};
    const auto prog = serve(rt, {}, {0}, 10, plan, &sw, layers);
    REQUIRE(captured == expected_captures(rt, c));
    REQUIRE(rt.captures() == captured);
    REQUIRE(rt.hybrid_steps() >= 2);
    REQUIRE((rt.graph_replays() > 0 || !rt.graphs_enabled()));
    // Every hybrid step but step 1 (seq 0's second prefill chunk: several tokens, eager) is a
    // decode step of 3 tokens and replays per-layer graphs.
    if (rt.hybrid_graphs_enabled())
      REQUIRE(rt.hybrid_graph_steps() == rt.hybrid_steps() - 1);
    else
      REQUIRE(rt.hybrid_graph_steps() == 0);
    REQUIRE(sw.mode() == parallel_mode::ep);
    // The hybrid steps' logits against the float64 model, then token for token the static run.
    check_against_reference(c, w, prog, false);
    for (size_t q = 0; q < base.seqs.size(); ++q) {
      for (size_t i = 0; i < base.seqs[q].size(); ++i) {
        if (base.seqs[q][i] == prog.seqs[q][i]) continue;
        std::ostringstream why;
        const size_t k = i - (base.seqs[q].size() - base.logits[q].size());
        const auto& la = base.logits[q][k];
        const auto& lb = prog.logits[q][k];
        why << "sequence " << q << " token " << i << ": static " << base.seqs[q][i] << " (logit "
            << la[static_cast<size_t>(base.seqs[q][i])] << "), progressive " << prog.seqs[q][i]
            << " (logit " << lb[static_cast<size_t>(prog.seqs[q][i])] << ")";
        FAIL(why.str());
      }
    }
  }
}

// Hybrid decode steps through per-layer graphs against the same steps run eagerly (a second
// runtime with the same weights and set_hybrid_eager(true)): B sequences decode one token
// per step at positions 0, 1, ..., the cursor walking 0 .. L and back (TP and EP tables both
// reserved up front, as a progressive switch freezes them), tokens drawn from a seed.
// P = 1 (any machine): bit for bit. With one rank and B a bucket size the eager step runs
// the graphs' shapes: rows = the bucket in both modes, and the graphs' expert capacity
// (1.25x the expected pairs + k) is never below the worst case (T k) when every expert is
// local, so both run the same kernels with the same launch shapes on the same data in the
// same order. P = 2 (two devices, fp32 only): EP graphs size the expert tiles for 1.25x the
// expected pairs and eager steps for the worst case, so other tile rows and other GEMM
// blockings sum in another order: within 1e-4 + 1e-4 |x| (the TP-vs-EP bound).
TEST_CASE(
    "gpu_runtime: hybrid steps through per-layer graphs give the eager hybrid steps' "
    "logits",
    "[gpu][runtime]") {
  std::vector<int> rank_counts = {1};
  if (test_ranks() == 2) rank_counts.push_back(2);
  for (int P : rank_counts)
    for (moebius::dtype t : {moebius::dtype::fp32, moebius::dtype::bf16}) {
      if (P == 2 && t == moebius::dtype::bf16) continue;  // see above
      for (int64_t B : {int64_t{1}, int64_t{4}, int64_t{8}}) {
        DYNAMIC_SECTION("P " << P << " dtype " << moebius::to_string(t) << " batch " << B) {
          const model_config c = tiny_config(t);  // L = 3
          const bool bf16 = t == moebius::dtype::bf16;
          const test_weights w = make_test_weights(c, seed(25), bf16);
          gpu_runtime graphed(w, tiny_options(P, {0}, t));
          gpu_runtime eager(w, tiny_options(P, {0}, t));
          eager.set_hybrid_eager(true);
          std::vector<int64_t> cursors;
          for (int64_t k = 0; k <= c.num_layers; ++k) cursors.push_back(k);
          for (int64_t k = c.num_layers; k >= 0; --k) cursors.push_back(k);
          const auto steps = static_cast<int64_t>(cursors.size());
          moebius::kv_state tp = empty_kv_state(graphed.kv(), parallel_mode::tp);
          moebius::kv_state ep = empty_kv_state(graphed.kv(), parallel_mode::ep);
          for (int64_t q = 0; q < B; ++q) {
            reserve_tokens(graphed.kv(), tp, q, steps, static_cast<int>(q % P));
            reserve_tokens(graphed.kv(), ep, q, steps, static_cast<int>(q % P));
          }
          moebius::validate(graphed.kv(), tp);
          moebius::validate(graphed.kv(), ep);
          std::mt19937_64 rng(seed(26));
          std::vector<int32_t> tokens(static_cast<size_t>(B));
          for (int64_t s = 0; s < steps; ++s) {
            INFO("step " << s << " cursor " << cursors[static_cast<size_t>(s)]);
            std::vector<step_item> items(static_cast<size_t>(B));
            for (int64_t q = 0; q < B; ++q) {
              tokens[static_cast<size_t>(q)] = static_cast<int32_t>(rng() % c.vocab);
              items[static_cast<size_t>(q)] = {q, {&tokens[static_cast<size_t>(q)], 1}, s, true};
            }
            const step_layout layout = step_layout::hybrid_of(
                tp, ep, moebius::arena_cursor{cursors[static_cast<size_t>(s)]});
            std::vector<std::vector<float>> lg, le;
            const std::vector<int32_t> ng = graphed.step(layout, items, &lg);
            const std::vector<int32_t> ne = eager.step(layout, items, &le);
            REQUIRE(ng == ne);
            REQUIRE(lg.size() == static_cast<size_t>(B));
            REQUIRE(le.size() == lg.size());
            for (size_t i = 0; i < lg.size(); ++i) {
              INFO("sequence " << i);
              REQUIRE(lg[i].size() == static_cast<size_t>(c.vocab));
              REQUIRE(le[i].size() == lg[i].size());
              int64_t differ = 0;
              for (size_t v = 0; v < lg[i].size(); ++v) {
                if (P == 1)
                  differ += std::memcmp(&lg[i][v], &le[i][v], sizeof(float)) != 0;
                else
                  differ += !(std::fabs(lg[i][v] - le[i][v]) <= 1e-4 + 1e-4 * std::fabs(le[i][v]));
                REQUIRE(std::isfinite(lg[i][v]));
              }
              INFO(differ << " of " << lg[i].size() << " logits differ");
              REQUIRE(differ == 0);
            }
          }
          REQUIRE(graphed.hybrid_steps() == steps);
          REQUIRE(eager.hybrid_steps() == steps);
          REQUIRE(eager.hybrid_graph_steps() == 0);
          REQUIRE(graphed.hybrid_graph_steps() == (graphed.hybrid_graphs_enabled() ? steps : 0));
          REQUIRE(graphed.captures() == expected_captures(graphed, c));
          REQUIRE(eager.captures() == graphed.captures());
        }
      }
    }
}

// ---- virtual ranks ---------------------------------------------------------------------------

namespace {

// tiny_options with all P ranks on device 0 (collectives over device memory).
gpu_runtime_options virtual_options(int P, moebius::arena_cursor cursor, moebius::dtype t) {
  gpu_runtime_options o = tiny_options(P, cursor, t);
  o.placement = rank_placement::virtual_ranks;
  return o;
}

// Every rank's KV pool set to 0xff bytes (NaN in fp32 and bf16): a step that reads a position
// nobody wrote, or a page a switch forgot, turns its logits into NaN.
void poison_kv(const gpu_runtime& rt) {
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
void check_arena(const gpu_runtime& rt, const test_weights& w, moebius::arena_cursor cursor) {
  const moebius::arena_geometry& g = rt.arena();
  const size_t P = static_cast<size_t>(rt.num_ranks()), slot = static_cast<size_t>(g.slot_bytes);
  const std::vector<moebius::rank_memory> mem = rt.memory();
  MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());
  for (int64_t l = 0; l < w.config.num_layers; ++l) {
    const parallel_mode m = moebius::arena_geometry::mode_of(cursor, l);
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
void require_same_tokens(const serve_result& base, const serve_result& got, const char* what,
                         bool bf16 = false) {
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
void require_close_logits(const serve_result& base, const serve_result& got, double tol) {
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

}  // namespace

TEST_CASE("virtual ranks: placement (automatic on one device, refused one per device)",
          "[gpu][runtime][virtual]") {
  int devices = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&devices));
  const model_config c = tiny_config(moebius::dtype::fp32);
  const test_weights w = make_test_weights(c, seed(30), false);
  const int P = devices + 1;  // one more rank than devices
  gpu_runtime_options o = tiny_options(P, {0}, moebius::dtype::fp32);
  o.capture_graphs = false;
  if (c.num_q_heads % P == 0 && c.num_experts % P == 0) {
    gpu_runtime automatic(w, o);
    REQUIRE(automatic.virtual_ranks());
    REQUIRE(automatic.num_ranks() == P);
    for (const moebius::rank_memory& m : automatic.memory()) REQUIRE(m.device == 0);
    o.placement = rank_placement::one_per_device;
    REQUIRE_THROWS_AS(gpu_runtime(w, o), moebius::error);
  }
  gpu_runtime one(w, tiny_options(1, {0}, moebius::dtype::fp32));
  REQUIRE(!one.virtual_ranks());
}

TEST_CASE("virtual ranks: static TP and EP runs give P = 1's greedy tokens and the float64 "
          "model's logits",
          "[gpu][runtime][virtual]") {
  for (moebius::dtype t : {moebius::dtype::fp32, moebius::dtype::bf16}) {
    const model_config c = tiny_config(t);  // L = 3, Hq = 4, Hkv = 2, E = 8
    const bool bf16 = t == moebius::dtype::bf16;
    const test_weights w = make_test_weights(c, seed(31), bf16);
    for (parallel_mode mode : {parallel_mode::ep, parallel_mode::tp}) {
      const int64_t k = mode == parallel_mode::tp ? c.num_layers : 0;
      for (int P : {2, 4}) {
        DYNAMIC_SECTION("dtype " << moebius::to_string(t) << " " << moebius::to_string(mode)
                                 << " P " << P << " virtual") {
          gpu_runtime one(w, tiny_options(1, {k}, t));
          const auto base = serve(one, empty_kv_state(one.kv(), mode), {k}, 6, {}, nullptr);
          gpu_runtime rt(w, virtual_options(P, {k}, t));
          REQUIRE(rt.virtual_ranks());
          REQUIRE(rt.num_ranks() == P);
          REQUIRE(rt.captures() == expected_captures(rt, c));
          poison_kv(rt);
          check_arena(rt, w, {k});
          const auto r = serve(rt, empty_kv_state(rt.kv(), mode), {k}, 6, {}, nullptr);
          check_against_reference(c, w, r, bf16);
          require_same_tokens(base, r, "virtual ranks", bf16);
          if (rt.graphs_enabled()) REQUIRE(rt.graph_replays() == 6);  // decode steps 2..7
          REQUIRE(rt.captures() == expected_captures(rt, c));
        }
      }
    }
  }
}

TEST_CASE("virtual ranks: stop-the-world and progressive switches EP -> TP -> EP keep the "
          "static run's tokens, place the arena as a static run and never re-capture",
          "[gpu][runtime][virtual]") {
  for (moebius::dtype t : {moebius::dtype::fp32, moebius::dtype::bf16}) {
    const model_config c = tiny_config(t);  // L = 3
    const bool bf16 = t == moebius::dtype::bf16;
    const test_weights w = make_test_weights(c, seed(32), bf16);
    for (int P : {2, 4}) {
      // 0: stop-the-world (TP before decode step 3, EP again before 6); 1, 2: progressive
      // with that many layers per step (TP from step 1: seq 0's second prefill chunk runs
      // hybrid; EP from 6).
      for (int64_t layers : {int64_t{0}, int64_t{1}, int64_t{2}}) {
        DYNAMIC_SECTION("dtype " << moebius::to_string(t) << " P " << P << " virtual, "
                                 << (layers == 0 ? "stop-the-world"
                                                 : "progressive, layers per step ")
                                 << (layers == 0 ? "" : std::to_string(layers))) {
          gpu_runtime static_rt(w, virtual_options(P, {0}, t));
          poison_kv(static_rt);
          const auto base = serve(static_rt, empty_kv_state(static_rt.kv(), parallel_mode::ep),
                                  {0}, 10, {}, nullptr);

          gpu_runtime rt(w, virtual_options(P, {0}, t));
          REQUIRE(rt.virtual_ranks());
          const int64_t captured = rt.captures();
          REQUIRE(captured == expected_captures(rt, c));
          poison_kv(rt);
          moebius::cuda_peer_transport tr =
              moebius::cuda_peer_transport::single_process(rt.memory());
          moebius::switcher sw(rt.arena(), rt.kv(), tr,
                               empty_kv_state(rt.kv(), parallel_mode::ep), {0});
          const std::map<int, parallel_mode> plan =
              layers == 0
                  ? std::map<int, parallel_mode>{{3, parallel_mode::tp}, {6, parallel_mode::ep}}
                  : std::map<int, parallel_mode>{{1, parallel_mode::tp}, {6, parallel_mode::ep}};
          int64_t moves = 0;
          const auto run = serve(rt, {}, {0}, 10, plan, &sw, layers, [&](moebius::arena_cursor k) {
            check_arena(rt, w, k);
            ++moves;
          });
          // Stop-the-world: 2 switches; progressive: per switch ceil(L / layers) advances and
          // the finish.
          const int64_t per_switch = layers == 0 ? 1 : (c.num_layers + layers - 1) / layers + 1;
          REQUIRE(moves == 2 * per_switch);
          REQUIRE(sw.mode() == parallel_mode::ep);
          REQUIRE(rt.captures() == captured);
          REQUIRE((rt.graph_replays() > 0 || !rt.graphs_enabled()));
          if (layers > 0) {
            REQUIRE(rt.hybrid_steps() >= 2);
            // Every hybrid step but step 1 (a prefill chunk: eager) replays per-layer graphs.
            if (rt.hybrid_graphs_enabled())
              REQUIRE(rt.hybrid_graph_steps() == rt.hybrid_steps() - 1);
          }
          check_against_reference(c, w, run, bf16);
          require_same_tokens(base, run, layers == 0 ? "stop-the-world" : "progressive", bf16);
          // TP and EP round their sums differently (the TP-vs-EP test's bound).
          if (!bf16) require_close_logits(base, run, 1e-4);
        }
      }
    }
  }
}

TEST_CASE("virtual ranks: progressive switches with the copies beside the steps keep the "
          "static run's tokens, place the arena as a static run, never re-capture, and roll "
          "back exactly from a fault in an overlapped advance",
          "[gpu][runtime][virtual][overlap]") {
  for (moebius::dtype t : {moebius::dtype::fp32, moebius::dtype::bf16}) {
    const model_config c = tiny_config(t);  // L = 3
    const bool bf16 = t == moebius::dtype::bf16;
    const test_weights w = make_test_weights(c, seed(33), bf16);
    for (int P : {2, 4}) {
      for (int64_t layers : {int64_t{1}, int64_t{2}}) {
        // -1: no fault; else a transport fault at phase 1 of that advance (the second
        // advance of the EP -> TP switch, or the first of the TP -> EP one).
        for (int fault : {-1, 1, 1 + static_cast<int>((c.num_layers + layers - 1) / layers)}) {
          DYNAMIC_SECTION("dtype " << moebius::to_string(t) << " P " << P << " layers per step "
                                   << layers << " fault at advance " << fault) {
            gpu_runtime static_rt(w, virtual_options(P, {0}, t));
            poison_kv(static_rt);
            const auto base = serve(static_rt, empty_kv_state(static_rt.kv(), parallel_mode::ep),
                                    {0}, 10, {}, nullptr);
            gpu_runtime rt(w, virtual_options(P, {0}, t));
            const int64_t captured = rt.captures();
            poison_kv(rt);
            moebius::cuda_peer_transport tr =
                moebius::cuda_peer_transport::single_process(rt.memory());
            moebius::switcher sw(rt.arena(), rt.kv(), tr,
                                 empty_kv_state(rt.kv(), parallel_mode::ep), {0});
            overlap_options beside;
            beside.fault_advance = fault;
            beside.fault_phase = 1;
            int64_t moves = 0;
            const auto run = serve(
                rt, {}, {0}, 10, {{1, parallel_mode::tp}, {6, parallel_mode::ep}}, &sw, layers,
                [&](moebius::arena_cursor k) {
                  check_arena(rt, w, k);
                  ++moves;
                },
                &beside);
            REQUIRE(beside.advances >= 2);
            REQUIRE(beside.rolled_back == (fault >= 0 ? 1 : 0));
            REQUIRE(moves >= beside.advances);
            REQUIRE(rt.captures() == captured);
            if (rt.hybrid_graphs_enabled()) REQUIRE(rt.hybrid_graph_steps() >= 1);
            check_against_reference(c, w, run, bf16);
            require_same_tokens(base, run, "progressive beside the steps", bf16);
            if (!bf16) require_close_logits(base, run, 1e-4);
          }
        }
      }
    }
  }
}

// Qwen3-30B-A3B's layer shapes (H 2048, 32 query and 4 KV heads of 128, 128 experts of I 768,
// top-8, pages of 16) with 2 layers and a 4096-token vocabulary (the embedding and LM head are
// not what a switch moves), fp32 so that TP and EP agree to rounding: progressive switches with
// the copies beside the steps, EP -> TP -> EP at P = 2 and 4 virtual ranks, against a static EP
// run: the same greedy tokens, logits within the TP-vs-EP bound, the arena read back after each
// switch (2.4 GB of experts per layer: not after every advance) equal to the static placement
// byte for byte. Stop-the-world at these shapes: the under-load benchmark.
TEST_CASE("virtual ranks, Qwen3-30B-A3B layer shapes: switches with the copies beside the "
          "steps keep the static run's tokens and place the arena exactly",
          "[gpu][runtime][virtual][overlap][qwen3_30b]") {
  model_config c = qwen3_30b_a3b();
  c.num_layers = 2;
  c.vocab = 4096;
  c.expert_dtype = moebius::dtype::fp32;
  c.kv_dtype = moebius::dtype::fp32;
  const test_weights w = make_test_weights(c, seed(34), false);
  for (int P : {2, 4}) {
    for (int64_t layers : {int64_t{1}}) {
      DYNAMIC_SECTION("P " << P << " progressive beside, layers per step " << layers) {
        gpu_runtime_options o = virtual_options(P, {0}, moebius::dtype::fp32);
        o.buckets = {1, 4};
        gpu_runtime static_rt(w, o);
        poison_kv(static_rt);
        const auto base = serve(static_rt, empty_kv_state(static_rt.kv(), parallel_mode::ep), {0},
                                6, {}, nullptr);
        gpu_runtime rt(w, o);
        const int64_t captured = rt.captures();
        poison_kv(rt);
        moebius::cuda_peer_transport tr = moebius::cuda_peer_transport::single_process(rt.memory());
        moebius::switcher sw(rt.arena(), rt.kv(), tr, empty_kv_state(rt.kv(), parallel_mode::ep),
                             {0});
        overlap_options beside;
        int64_t moves = 0;
        const auto run = serve(
            rt, {}, {0}, 6, {{2, parallel_mode::tp}, {5, parallel_mode::ep}}, &sw, layers,
            [&](moebius::arena_cursor k) {
              if (k.tp_layers == 0 || k.tp_layers == c.num_layers) {
                if (++moves % 2 == 0) check_arena(rt, w, k);  // the finish after the last advance
              }
            },
            &beside);
        REQUIRE(moves == 4);
        REQUIRE(beside.advances == 2 * c.num_layers);
        REQUIRE(sw.mode() == parallel_mode::ep);
        REQUIRE(rt.captures() == captured);
        require_same_tokens(base, run, "progressive beside");
        require_close_logits(base, run, 1e-4);
      }
    }
  }
}
