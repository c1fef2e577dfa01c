// The GPU runtime's step and its public interface (gpu_runtime.hpp); the parts it runs are
// listed in runtime_impl.hpp.

#include <algorithm>
#include <moebius/error.hpp>
#include <string>

#include "runtime_impl.hpp"

namespace mini_engine::gpu {

using moebius::dtype;
using moebius::errc;
using moebius::parallel_mode;

void gpu_runtime::impl::serve_at_dcp(int64_t d) {
  if (d == kv.dcp) return;
  if (!std::binary_search(dcps.begin(), dcps.end(), d)) {
    std::string served;
    for (int64_t x : dcps) served += (served.empty() ? "" : ", ") + std::to_string(x);
    MOEBIUS_FAIL(errc::invalid_argument, "gpu_runtime::step: step_layout::dcp ", d,
                 " is not one the runtime serves (", served,
                 ": gpu_runtime_options::dcp and serve_dcps); its graphs and buffers are made "
                 "at construction for those");
  }
  kv = moebius::with_dcp(kv_built, d);
}

// One step (step.hpp), enqueued: the token layout and input block of every mode it uses, a
// graph replay (whole-model, or per layer for a hybrid decode step) or the same code eagerly,
// all launched on every rank's stream; finish() waits and reads the greedy tokens back.
pending_step gpu_runtime::impl::enqueue(const step_layout& layout,
                                        std::span<const step_item> items,
                                        const step_options& opts) {
  MOEBIUS_CHECK(!flight.pending, errc::internal, "gpu_runtime::enqueue: step ", flight.serial,
                " is still pending (finish it first)");
  const bool hybrid = layout.hybrid();
  MOEBIUS_CHECK(hybrid || layout.tables != nullptr, errc::invalid_argument,
                "gpu_runtime::step: no page tables");
  // The step's TP dcp (0: the constructed one): its graphs, shares and exchanges from here.
  serve_at_dcp(layout.dcp == 0 ? o.dcp : layout.dcp);
  moebius::validate(arena, layout.cursor);
  bool decode = true;
  for (size_t i = 0; i < items.size(); ++i) {
    MOEBIUS_CHECK(!items[i].tokens.empty(), errc::invalid_argument, "gpu_runtime::step: item ", i,
                  " has no tokens");
    decode = decode && items[i].tokens.size() == 1;
  }
  // The mode of every layer (static: the tables' mode; hybrid: TP below the cursor), and
  // each used mode's layout and input block, with as many rows as its largest rank holds.
  pass& ps = flight.ps;
  ps = pass{};
  ps.cursor = layout.cursor;
  ps.attn = layer_modes(layout, c.num_layers);
  bool used[2] = {false, false};
  token_layout lay[2];
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const parallel_mode m = ps.attn[static_cast<size_t>(l)];
    if (used[mode_index(m)]) continue;
    used[mode_index(m)] = true;
    lay[mode_index(m)] = build_inputs(m, layout.tables_of_layer(l), items);
    ps.rows[mode_index(m)] = lay[mode_index(m)].max_count();
  }
  const parallel_mode first = ps.attn.front(), last = ps.attn.back();
  const bool pure =
      !hybrid && ((first == parallel_mode::tp && layout.cursor.tp_layers == c.num_layers) ||
                  (first == parallel_mode::ep && layout.cursor.tp_layers == 0));
  prof_on = o.profile;  // a profiled step runs eagerly (events between the stages)
  for (rank_state& rs : ranks) rs.prof.used = 0;
  // Graphs round the rows up to their bucket; the maps below index the bucket's rows.
  const bool graphs_allowed = decode && !opts.rerun;
  const graph_set* gs = graphs_allowed && pure ? whole_model_graph(ps) : nullptr;
  const std::vector<const graph_set*> layer_gs =
      graphs_allowed && hybrid ? layer_graphs_of(ps, used) : std::vector<const graph_set*>{};
  if (used[0] && used[1])
    write_hand_off_maps(lay[mode_index(parallel_mode::tp)], lay[mode_index(parallel_mode::ep)],
                        items, ps.rows[mode_index(parallel_mode::ep)]);
  // The row each sampled item's logits come from, in the last layer's layout: (rank, row).
  flight.sample_at = last_token_rows(lay[mode_index(last)], items);
  each_rank([&](int r, rank_state& rs) {
    // A rerun is timed from the first pass's start: the step took both.
    if (!opts.rerun) MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.step_begin, rs.stream));
    mark(rs, -1);
    upload_inputs(rs, r, used, lay, ps.rows);
    mark(rs, st_upload);
  });
  if (hybrid && !opts.rerun) ++hybrid_steps;
  // Layer events only where a step has layer boundaries to give: a static layout finishes as
  // one piece (one whole-model graph), and copies beside it follow finish().
  record_events = opts.layer_events && hybrid;
  flight.replayed = gs != nullptr || !layer_gs.empty();
  if (flight.replayed) {
    launch_graphs(gs, layer_gs, ps);
    if (hybrid) ++hybrid_graph_steps;
  } else {
    forward(ps, false);
    ++eager;
  }
  const bool events = record_events;
  record_events = false;
  flight.items.assign(items.begin(), items.end());
  flight.logits = opts.logits;
  flight.pending = true;
  return pending_step{events ? &*layer_events : nullptr, ++flight.serial};
}

// Waits for the pending step: its routing's overflow flags after a graph replay (then the
// caller reruns it), else its tokens and device time.
step_result gpu_runtime::impl::finish(const pending_step& p) {
  MOEBIUS_CHECK(flight.pending && p.serial == flight.serial, errc::invalid_argument,
                "gpu_runtime::finish: step ", p.serial, " is not the pending step (",
                flight.serial, flight.pending ? ")" : ", finished)");
  flight.pending = false;
  step_result r;
  if (flight.replayed && replay_overflowed()) {
    // Routing beyond the graph's expert capacity on some rank: the step's outputs are
    // incomplete. The caller runs it again eagerly with the worst-case capacity (rerun): it
    // writes every layer's K/V of the step's positions again (the first pass's values after
    // the overflow were wrong), and reads nothing else the first pass wrote.
    prof_on = false;
    r.overflowed = true;
    return r;
  }
  r.tokens = read_results(flight.ps, flight.items, flight.sample_at, flight.logits);
  r.measured_s = last_step_s;
  return r;
}

// A pure decode step's whole-model graph: the smallest bucket of its mode that holds its rows
// (ps.rows rounded up to it), or null (graphs off, profiling, a batch beyond the buckets).
const graph_set* gpu_runtime::impl::whole_model_graph(pass& ps) {
  const parallel_mode first = ps.attn.front();
  if (!o.capture_graphs || o.profile) return nullptr;
  const int64_t T = graph_cache::bucket_for(graphs.whole_model, o.buckets, first, kv.dcp,
                                            ps.rows[mode_index(first)]);
  if (T == 0) return nullptr;
  ps.rows[mode_index(first)] = T;
  return &graphs.whole_model.at(graph_cache::key_of(first, kv.dcp, T));
}

// A hybrid decode step's per-layer graphs: layer l's graph, from the graphs of its mode at
// that mode's bucket (each mode picks its own: TP holds every token, EP a rank's); ps.rows
// rounded up to them. Empty (eager) when they are off or a mode's rows exceed every bucket.
std::vector<const graph_set*> gpu_runtime::impl::layer_graphs_of(pass& ps, const bool used[2]) {
  std::vector<const graph_set*> layer_gs;
  if (!o.hybrid_graphs || hybrid_eager || o.profile) return layer_gs;
  int64_t T[2] = {0, 0};
  bool fits = true;
  for (parallel_mode m : {parallel_mode::ep, parallel_mode::tp}) {
    if (!used[mode_index(m)]) continue;
    T[mode_index(m)] =
        graph_cache::bucket_for(graphs.per_layer, o.buckets, m, kv.dcp, ps.rows[mode_index(m)]);
    fits = fits && T[mode_index(m)] != 0;
  }
  if (!fits) return layer_gs;  // a batch beyond the largest bucket: eagerly
  for (int mi = 0; mi < 2; ++mi)
    if (used[mi]) ps.rows[mi] = T[mi];
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const parallel_mode m = ps.attn[static_cast<size_t>(l)];
    layer_gs.push_back(
        &graphs.per_layer.at(graph_cache::key_of(m, kv.dcp, T[mode_index(m)]))[static_cast<size_t>(l)]);
  }
  return layer_gs;
}

// Launches the step's graphs (whole-model `gs`, or per-layer `layer_gs` with the hand-off
// eagerly between them) on every rank, each rank's overflow flag cleared first.
void gpu_runtime::impl::launch_graphs(const graph_set* gs,
                                      const std::vector<const graph_set*>& layer_gs,
                                      const pass& ps) {
  // Every rank's graph is launched before anything waits: the graphs' NCCL calls need
  // all ranks running (a copy to pageable memory would block the host on rank 0 first).
  each_rank([&](int, rank_state& rs) {
    MOEBIUS_CUDA_CHECK(cudaMemsetAsync(rs.moe.overflow, 0, 4, rs.stream));
  });
  if (gs != nullptr) launch(*gs);
  // Hybrid: layer by layer, each layer's graph on every rank before the next layer's (the
  // order of the NCCL calls inside them is the same on every rank), the hand-off eagerly
  // where the mode changes (its maps and row counts are this step's: the buckets above).
  for (size_t l = 0; l < layer_gs.size(); ++l) {
    if (l > 0 && ps.attn[l] != ps.attn[l - 1]) hand_off(ps.attn[l - 1], ps.attn[l], ps);
    launch(*layer_gs[l]);
    record_layer_done(static_cast<int64_t>(l));
  }
}

// Waits for the replayed step on every rank; true when some rank's routing overflowed the
// graphs' expert capacity.
bool gpu_runtime::impl::replay_overflowed() {
  std::vector<int32_t> overflow(static_cast<size_t>(P), 0);
  each_rank([&](int r, rank_state& rs) {
    MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(rs.stream));
    MOEBIUS_CUDA_CHECK(
        cudaMemcpy(&overflow[static_cast<size_t>(r)], rs.moe.overflow, 4, cudaMemcpyDeviceToHost));
  });
  ++replays;
  if (!std::any_of(overflow.begin(), overflow.end(), [](int32_t f) { return f != 0; }))
    return false;
  ++reruns;
  return true;
}

// Downloads every rank's next-token candidates, waits for the step, records its device time
// (and the stage profile), and picks each sampled item's token (and logits row).
std::vector<int32_t> gpu_runtime::impl::read_results(
    const pass& ps, std::span<const step_item> items,
    const std::vector<std::pair<int, int64_t>>& sample_at,
    std::vector<std::vector<float>>* logits_out) {
  std::vector<std::vector<int32_t>> next(static_cast<size_t>(P));
  std::vector<std::vector<float>> next_value(static_cast<size_t>(P));
  download(ps, next, next_value);
  return pick_tokens(ps, items, sample_at, next, next_value, logits_out);
}

// Every rank's candidates (next[r][t], next_value[r][t]: the argmax of row t in rank r's vocab
// slice, and its logit) to the host; waits for the step; its device time and stage profile.
void gpu_runtime::impl::download(const pass& ps, std::vector<std::vector<int32_t>>& next,
                                 std::vector<std::vector<float>>& next_value) {
  const parallel_mode last = ps.attn.back();
  // Results (every rank's work is enqueued: waiting on one rank at a time is safe now).
  const int64_t T = ps.rows[mode_index(last)];
  each_rank([&](int r, rank_state& rs) {
    next[static_cast<size_t>(r)].resize(static_cast<size_t>(T));
    next_value[static_cast<size_t>(r)].resize(static_cast<size_t>(T));
    MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(next[static_cast<size_t>(r)].data(), rs.next,
                                       static_cast<size_t>(T) * 4, cudaMemcpyDeviceToHost,
                                       rs.stream));
    MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(next_value[static_cast<size_t>(r)].data(), rs.next_value,
                                       static_cast<size_t>(T) * 4, cudaMemcpyDeviceToHost,
                                       rs.stream));
    mark(rs, st_download);
    MOEBIUS_CUDA_CHECK(cudaEventRecord(rs.step_end, rs.stream));
  });
  each_rank([&](int, rank_state& rs) { MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(rs.stream)); });
  if (prof_on) {
    collect_profile();
    prof_on = false;
  }
  // The step's device time: the longest rank, from its first upload to its last download.
  last_step_s = 0;
  each_rank([&](int, rank_state& rs) {
    float ms = 0;
    MOEBIUS_CUDA_CHECK(cudaEventElapsedTime(&ms, rs.step_begin, rs.step_end));
    last_step_s = std::max(last_step_s, static_cast<double>(ms) * 1e-3);
  });
}

// Each sampled item's greedy token from the ranks' candidates (and its logits row, copied
// from the ranks' slices, when logits_out is given); -1 for the others.
std::vector<int32_t> gpu_runtime::impl::pick_tokens(
    const pass& ps, std::span<const step_item> items,
    const std::vector<std::pair<int, int64_t>>& sample_at,
    const std::vector<std::vector<int32_t>>& next,
    const std::vector<std::vector<float>>& next_value,
    std::vector<std::vector<float>>* logits_out) {
  const parallel_mode last = ps.attn.back();
  std::vector<int32_t> out(items.size(), -1);
  if (logits_out != nullptr) logits_out->clear();
  const bool split_vocab = vocab_slice(last, 0).second != c.vocab;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!items[i].sample) continue;
    const auto [owner, t] = sample_at[i];
    // TP with a split vocabulary: every rank's candidate for token t; the largest logit
    // wins, ties to the lower vocab id (slices ascend with the rank).
    const int lo = split_vocab ? 0 : owner, hi = split_vocab ? P - 1 : owner;
    float best = 0.0f;
    for (int r = lo; r <= hi; ++r) {
      const float v = next_value[static_cast<size_t>(r)][static_cast<size_t>(t)];
      const int32_t id = static_cast<int32_t>(vocab_slice(last, r).first) +
                         next[static_cast<size_t>(r)][static_cast<size_t>(t)];
      if (r == lo || v > best) {
        best = v;
        out[i] = id;
      }
    }
    if (logits_out != nullptr) {
      std::vector<float> row(static_cast<size_t>(c.vocab));
      for (int r = lo; r <= hi; ++r) {
        rank_state& rs = ranks[static_cast<size_t>(r)];
        const auto [v0, vn] = vocab_slice(last, r);
        set_device(rs);
        MOEBIUS_CUDA_CHECK(cudaMemcpy(row.data() + v0, rs.logits + t * vn,
                                      static_cast<size_t>(vn) * 4, cudaMemcpyDeviceToHost));
      }
      logits_out->push_back(std::move(row));
    }
  }
  return out;
}

gpu_runtime::gpu_runtime(const model_weights& weights, const gpu_runtime_options& options)
    : impl_(std::make_unique<impl>()) {
  impl_->setup(weights.config, options);
  impl_->upload_weights(weights);
  if (impl_->o.capture_graphs) impl_->capture_all();
}

gpu_runtime::gpu_runtime(const model_config& config, const gpu_runtime_options& options,
                         const std::function<void(weight_sink&)>& load)
    : impl_(std::make_unique<impl>()) {
  impl_->setup(config, options);
  impl_->stream_weights(load);
  if (impl_->o.capture_graphs) impl_->capture_all();
}

gpu_runtime::gpu_runtime(const model_config& config, uint64_t seed,
                         const gpu_runtime_options& options)
    : impl_(std::make_unique<impl>()) {
  impl_->setup(config, options);
  impl_->random_weights(seed);
  if (impl_->o.capture_graphs) impl_->capture_all();
}

gpu_runtime::~gpu_runtime() = default;

pending_step gpu_runtime::enqueue(const step_layout& layout, std::span<const step_item> items,
                                  const step_options& options) {
  return impl_->enqueue(layout, items, options);
}

step_result gpu_runtime::finish(const pending_step& p) {
  return impl_->finish(p);
}

std::vector<moebius::rank_memory> gpu_runtime::memory() const {
  return impl_->memory->ranks();
}
const moebius::deployment_memory& gpu_runtime::deployment() const { return *impl_->memory; }
moebius::kv_pool_layout gpu_runtime::kv_layout() const {
  return moebius::present_kv_layout(impl_->kv_built);
}
const moebius::arena_geometry& gpu_runtime::arena() const {
  return impl_->arena;
}
const moebius::kv_geometry& gpu_runtime::kv() const {
  return impl_->kv_built;
}
const std::vector<int64_t>& gpu_runtime::serve_dcps() const {
  return impl_->dcps;
}
int64_t gpu_runtime::vocab_size() const {
  return impl_->c.vocab;
}
int gpu_runtime::num_ranks() const {
  return impl_->P;
}
bool gpu_runtime::virtual_ranks() const {
  return impl_->virt;
}
bool gpu_runtime::graphs_enabled() const {
  return impl_->o.capture_graphs;
}
int64_t gpu_runtime::captures() const {
  return impl_->graphs.captures;
}
int64_t gpu_runtime::graph_replays() const {
  return impl_->replays;
}
int64_t gpu_runtime::eager_steps() const {
  return impl_->eager;
}
int64_t gpu_runtime::overflow_reruns() const {
  return impl_->reruns;
}
int64_t gpu_runtime::hybrid_steps() const {
  return impl_->hybrid_steps;
}
int64_t gpu_runtime::hybrid_graph_steps() const {
  return impl_->hybrid_graph_steps;
}
bool gpu_runtime::hybrid_graphs_enabled() const {
  return impl_->o.hybrid_graphs;
}
void gpu_runtime::set_hybrid_eager(bool eager) {
  impl_->hybrid_eager = eager;
}
gpu_runtime::graph_stats gpu_runtime::graph_statistics() const {
  return impl_->graphs.stats;
}
bool gpu_runtime::profiling() const {
  return impl_->o.profile;
}
std::vector<std::pair<std::string, double>> gpu_runtime::stage_times() const {
  std::vector<std::pair<std::string, double>> out;
  for (size_t k = 0; k < impl_->stage_s.size(); ++k)
    out.emplace_back(stage_names[k], impl_->stage_s[k]);
  return out;
}

void gpu_runtime::fill_kv_random(uint64_t seed) {
  // Seeded by rank (= device, one rank per device), so virtual ranks differ too.
  impl_->each_rank([&](int r, rank_state& rs) {
    launch_fill_random({rs.kv_pool, impl_->c.kv_dtype,
                        impl_->kv_built.pool_bytes() / moebius::dtype_bytes(impl_->c.kv_dtype),
                        seed + static_cast<uint64_t>(r), 1.0f, 0.0f},
                       rs.stream);
    MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(rs.stream));
  });
}

}  // namespace mini_engine::gpu
