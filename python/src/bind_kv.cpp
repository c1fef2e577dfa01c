// The paged KV cache: geometry, the pool's layout (the engines' presets), page tables, placement
// and migration (kv/).

#include <nanobind/operators.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.hpp"

namespace moebius::python {

namespace {

kv_migration_options migration_options(int64_t staging_offset, int64_t staging_bytes,
                                       memory_space staging_space, int64_t max_rounds) {
  kv_migration_options o;
  o.staging = kv_staging{staging_space, staging_offset, staging_bytes};
  o.max_rounds = max_rounds;
  return o;
}

void bind_pool_layout(nb::module_& m) {
  nb::enum_<kv_preset>(m, "KvPreset",
                       "Which engine layout a KvPoolLayout was built for (the strides are the "
                       "truth).")
      .value("present", kv_preset::present, "Moebius's own pool [layer][K|V][page]")
      .value("vllm_flash_attn", kv_preset::vllm_flash_attn,
             "vLLM v1 FlashAttention: per layer (2, num_blocks, block_size, H, D)")
      .value("vllm_flashinfer", kv_preset::vllm_flashinfer,
             "vLLM v1 FlashInfer: per layer (num_blocks, 2, block_size, H, D)")
      .value("sglang_mha", kv_preset::sglang_mha,
             "SGLang MHATokenToKVPool: k_buffer[l], v_buffer[l] = [tokens, H, D]")
      .value("custom", kv_preset::custom, "strides given by the caller");

  record<kv_strides> strides(
      m, "KvStrides",
      "Byte strides of one view of a KV pool: offset(layer, t, page, head, token, dim) =\n"
      "base + layer*layer + t*kv + page*page + token*token + head*head + dim*dim.");
  strides.def(
      "__init__",
      [](kv_strides* s, int64_t base, int64_t layer, int64_t kv, int64_t page, int64_t token,
         int64_t head, int64_t dim) { new (s) kv_strides{base, layer, kv, page, token, head, dim}; },
      nb::arg("base") = 0, nb::arg("layer") = 0, nb::arg("kv") = 0, nb::arg("page") = 0,
      nb::arg("token") = 0, nb::arg("head") = 0, nb::arg("dim") = 0);
  strides.field_rw("base", &kv_strides::base, "offset of (layer 0, K, page 0, token 0, head 0, dim 0)")
      .field_rw("layer", &kv_strides::layer)
      .field_rw("kv", &kv_strides::kv, "K -> V of one layer (ignored for latent KV)")
      .field_rw("page", &kv_strides::page)
      .field_rw("token", &kv_strides::token)
      .field_rw("head", &kv_strides::head, "head within the view's page")
      .field_rw("dim", &kv_strides::dim)
      .done();
  strides.def("tensor", &kv_strides::tensor, nb::arg("layer"), nb::arg("tensor"),
              "Offset of page 0 of tensor (layer, K|V).")
      .def("offset", &kv_strides::offset, nb::arg("layer"), nb::arg("tensor"), nb::arg("page"),
           nb::arg("head"), nb::arg("token"), nb::arg("dim"));

  record<kv_pool_layout> layout(
      m, "KvPoolLayout",
      "Where a rank's KV bytes lie (kv/kv_pool_layout.hpp): the EP view's strides and the TP\n"
      "view derived from them the way an engine running TP over the same buffer shapes it.\n"
      "Made by the presets (vllm_flashinfer_layout, ...) or make_kv_pool_layout; give it to\n"
      "Switcher(kv_layout=...) so every plan moves the cache where the engine's kernels read it.");
  layout.field("ep", &kv_pool_layout::ep, "the EP view's strides")
      .field("tp", &kv_pool_layout::tp, "the TP view's strides (derive_tp_strides of ep)")
      .field("pool_bytes", &kv_pool_layout::pool_bytes, "bytes of each rank's pool it addresses")
      .field("segment_bytes", &kv_pool_layout::segment_bytes,
             "0: one allocation; > 0: allocation i at [i*segment_bytes, (i+1)*segment_bytes)")
      .field("preset", &kv_pool_layout::preset)
      .done();
  layout.def("view", &kv_pool_layout::view, nb::arg("mode"), nb::rv_policy::copy,
             "The strides of `mode`'s view.")
      .def("offset", &kv_pool_layout::offset, nb::arg("mode"), nb::arg("layer"),
           nb::arg("tensor"), nb::arg("page"), nb::arg("head"), nb::arg("token"), nb::arg("dim"),
           "Byte offset of one element in a rank's pool (arguments as KvGeometry.offset).")
      .def("validate", [](const kv_pool_layout& l, const kv_geometry& g) { validate(g, l); },
           nb::arg("geometry"),
           "Raises moebius.Error(code='invalid_argument') naming the broken constraint.");

  record<kv_buffer_spacing> spacing(
      m, "KvBufferSpacing",
      "How an engine's per-layer buffers sit in the pool space (0 = packed back to back).");
  spacing.def(
      "__init__",
      [](kv_buffer_spacing* s, int64_t layer_stride, int64_t kv_stride, int64_t segment_bytes) {
        new (s) kv_buffer_spacing{layer_stride, kv_stride, segment_bytes};
      },
      nb::arg("layer_stride") = 0, nb::arg("kv_stride") = 0, nb::arg("segment_bytes") = 0);
  spacing.field_rw("layer_stride", &kv_buffer_spacing::layer_stride,
                   "bytes from layer l's buffer(s) to layer l+1's")
      .field_rw("kv_stride", &kv_buffer_spacing::kv_stride,
                "SGLang: bytes from layer l's K buffer to its V buffer")
      .field_rw("segment_bytes", &kv_buffer_spacing::segment_bytes,
                "KvPoolLayout.segment_bytes")
      .done();

  m.def("derive_tp_strides", &derive_tp_strides, nb::arg("geometry"), nb::arg("ep"),
        "The TP view of EP strides: strides inside a page and outside a head shrink by the\n"
        "split (tp_pages_per_ep_page), the others stay.");
  m.def("make_kv_pool_layout", &make_kv_pool_layout, nb::arg("geometry"), nb::arg("ep"),
        nb::arg("pool_bytes"), nb::arg("segment_bytes") = 0,
        nb::arg("preset") = kv_preset::custom,
        "A validated layout from EP strides (TP derived).");
  m.def("present_kv_layout", &present_kv_layout, nb::arg("geometry"),
        "Moebius's own pool [layer][K|V][page]: offset() is KvGeometry.offset().");
  m.def("vllm_flash_attn_layout", &vllm_flash_attn_layout, nb::arg("geometry"),
        nb::arg("spacing") = kv_buffer_spacing{},
        "vLLM v1 FlashAttention: per layer (2, num_blocks, block_size, H_kv, head_size), HND\n"
        "or NHD stride order as the geometry says; layer l at l * spacing.layer_stride.");
  m.def("vllm_flashinfer_layout", &vllm_flashinfer_layout, nb::arg("geometry"),
        nb::arg("spacing") = kv_buffer_spacing{},
        "vLLM v1 FlashInfer: per layer (num_blocks, 2, block_size, H_kv, head_size): K and V\n"
        "of a block side by side (page stride 2 * page bytes, kv stride one page).");
  m.def("sglang_mha_layout", &sglang_mha_layout, nb::arg("geometry"),
        nb::arg("spacing") = kv_buffer_spacing{},
        "SGLang MHATokenToKVPool: k_buffer[l], v_buffer[l] each [pages * page_size, H_kv, D]\n"
        "(token slot = page * page_size + token; the geometry must be NHD).");
  m.def("kv_preset_layout", &kv_preset_layout, nb::arg("preset"), nb::arg("geometry"),
        "The preset's layout for `geometry` with packed buffers.");
  m.def("kv_slices_in_place", &kv_slices_in_place, nb::arg("geometry"), nb::arg("layout"),
        "Whether head slice j of EP page p is exactly TP page p*split + j (EP->TP keeps the\n"
        "owner's slice in place).");
  m.def("kv_slice_is_block", &kv_slice_is_block, nb::arg("geometry"), nb::arg("layout"),
        "Whether a head slice of an EP page piece is one contiguous block.");
}

}  // namespace

void bind_kv(nb::module_& m) {
  nb::enum_<kv_layout>(m, "KvLayout", "Order of a KV page's dimensions.")
      .value("HND", kv_layout::hnd)
      .value("NHD", kv_layout::nhd);
  nb::enum_<kv_tensor>(m, "KvTensor").value("K", kv_tensor::k).value("V", kv_tensor::v);

  nb::class_<kv_geometry>(m, "KvGeometry",
                          "The paged KV pool of one rank: per (layer, K|V) a region of\n"
                          "num_ep_pages EP pages = num_tp_pages TP pages (same bytes).")
      .def_ro("num_layers", &kv_geometry::num_layers)
      .def_ro("num_kv_heads", &kv_geometry::num_kv_heads, "H_kv; 0 = latent KV (MLA)")
      .def_ro("head_dim", &kv_geometry::head_dim)
      .def_ro("page_size", &kv_geometry::page_size, "tokens per page, in both views")
      .def_ro("num_ep_pages", &kv_geometry::num_ep_pages)
      .def_ro("num_ranks", &kv_geometry::num_ranks)
      .def_ro("type", &kv_geometry::type)
      .def_ro("layout", &kv_geometry::layout)
      .def_ro("dcp", &kv_geometry::dcp,
              "the TP view's KV-parallel degree: the ranks sharing a head split its tokens\n"
              "(logical page i on DCP index i % dcp); 1: every TP rank holds every token")
      .def_prop_ro("tp_replica_sets", &kv_geometry::tp_replica_sets)
      .def("dcp_rank", &kv_geometry::dcp_rank, nb::arg("rank"), "DCP index of TP rank `rank`")
      .def("dcp_pages_held", &kv_geometry::dcp_pages_held, nb::arg("num_pages"), nb::arg("k"),
           "pages of a num_pages-page sequence DCP index k holds: ceil((n - k) / dcp)")
      .def("dcp_tokens_held", &kv_geometry::dcp_tokens_held, nb::arg("num_tokens"), nb::arg("k"))
      .def(
          "token_place",
          [](const kv_geometry& g, int64_t token) {
            const kv_token_place p = g.token_place(token);
            return nb::make_tuple(p.dcp_rank, p.local_page, p.slot);
          },
          nb::arg("token"),
          "(DCP index, local page, slot) of token `token` of a sequence in the TP view")
      .def_prop_ro("latent", &kv_geometry::latent)
      .def_prop_ro("kv_tensors", &kv_geometry::kv_tensors)
      .def_prop_ro("num_tensors", &kv_geometry::num_tensors)
      .def_prop_ro("heads_per_ep_page", &kv_geometry::heads_per_ep_page)
      .def_prop_ro("heads_per_tp_page", &kv_geometry::heads_per_tp_page)
      .def_prop_ro("tp_pages_per_ep_page", &kv_geometry::tp_pages_per_ep_page)
      .def_prop_ro("tp_replicas", &kv_geometry::tp_replicas)
      .def_prop_ro("num_tp_pages", &kv_geometry::num_tp_pages)
      .def_prop_ro("head_bytes", &kv_geometry::head_bytes)
      .def_prop_ro("ep_page_bytes", &kv_geometry::ep_page_bytes)
      .def_prop_ro("tp_page_bytes", &kv_geometry::tp_page_bytes)
      .def_prop_ro("region_bytes", &kv_geometry::region_bytes)
      .def_prop_ro("pool_bytes", &kv_geometry::pool_bytes)
      .def("tp_slice_of_rank", &kv_geometry::tp_slice_of_rank, nb::arg("rank"))
      .def("num_pages", &kv_geometry::num_pages, nb::arg("mode"))
      .def("page_bytes", &kv_geometry::page_bytes, nb::arg("mode"))
      .def("tensor_offset", &kv_geometry::tensor_offset, nb::arg("layer"), nb::arg("tensor"))
      .def("offset", &kv_geometry::offset, nb::arg("mode"), nb::arg("layer"), nb::arg("tensor"),
           nb::arg("page"), nb::arg("head"), nb::arg("token"), nb::arg("dim"),
           "Byte offset in a rank's pool of one element; `head` is the head within the page.")
      .def(nb::self == nb::self)
      .def("__repr__", &printed<kv_geometry>)
      .attr("__hash__") = nb::none();

  bind_pool_layout(m);

  m.def("make_kv_geometry", &make_kv_geometry, nb::arg("num_layers"), nb::arg("num_kv_heads"),
        nb::arg("head_dim"), nb::arg("page_size"), nb::arg("num_ep_pages"), nb::arg("num_ranks"),
        nb::arg("type") = dtype::bf16, nb::arg("layout") = kv_layout::hnd,
        "Builds and validates a KV geometry.\n"
        "Qwen3-235B, 64 pages, P=8: make_kv_geometry(94, 4, 128, 16, 64, 8).");
  m.def("with_dcp", &with_dcp, nb::arg("geometry"), nb::arg("dcp"),
        "The geometry with the TP view's KV-parallel degree `dcp` (decode context parallel):\n"
        "it must divide tp_replicas (H_kv < P: P / H_kv; latent KV: P; H_kv >= P: only 1).\n"
        "with_dcp(make_kv_geometry(94, 4, 128, 16, 64, 8), 2): ranks 2j, 2j+1 split head j's\n"
        "tokens; the TP view then holds what EP holds.");
  m.def("ep_pages_for_bytes", &ep_pages_for_bytes, nb::arg("geometry"), nb::arg("pool_bytes"),
        "The largest num_ep_pages whose pool fits in `pool_bytes`.");

  nb::class_<kv_sequence>(m, "KvSequence", "One sequence's page table on one rank.")
      .def(
          "__init__",
          [](kv_sequence* s, int64_t seq_id, int64_t num_tokens, int64_t last_page_len,
             std::vector<int64_t> pages, int64_t shared_prefix_pages, int64_t prefill_cursor) {
            new (s) kv_sequence{seq_id, num_tokens, last_page_len, shared_prefix_pages,
                                prefill_cursor, std::move(pages)};
          },
          nb::arg("seq_id") = 0, nb::arg("num_tokens") = 0, nb::arg("last_page_len") = 0,
          nb::arg("pages") = std::vector<int64_t>{}, nb::arg("shared_prefix_pages") = 0,
          nb::arg("prefill_cursor") = 0)
      .def_rw("seq_id", &kv_sequence::seq_id)
      .def_rw("num_tokens", &kv_sequence::num_tokens)
      .def_rw("last_page_len", &kv_sequence::last_page_len)
      .def_rw("shared_prefix_pages", &kv_sequence::shared_prefix_pages)
      .def_rw("prefill_cursor", &kv_sequence::prefill_cursor)
      .def_rw("pages", &kv_sequence::pages, "page ids in token order (a copy: assign to change)")
      .def_prop_ro("num_pages", &kv_sequence::num_pages)
      .def(nb::self == nb::self)
      .def("__repr__",
           [](const kv_sequence& s) {
             std::ostringstream os;
             os << "KvSequence(seq_id=" << s.seq_id << ", num_tokens=" << s.num_tokens
                << ", last_page_len=" << s.last_page_len << ", pages=[";
             for (size_t i = 0; i < s.pages.size(); ++i) os << (i ? ", " : "") << s.pages[i];
             os << "], shared_prefix_pages=" << s.shared_prefix_pages
                << ", prefill_cursor=" << s.prefill_cursor << ")";
             return os.str();
           })
      .attr("__hash__") = nb::none();

  nb::class_<kv_rank_state>(m, "KvRankState", "One rank's page tables and free list.")
      .def(
          "__init__",
          [](kv_rank_state* s, std::vector<kv_sequence> sequences, std::vector<int64_t> free) {
            new (s) kv_rank_state{std::move(sequences), std::move(free)};
          },
          nb::arg("sequences") = std::vector<kv_sequence>{},
          nb::arg("free_pages") = std::vector<int64_t>{})
      .def_rw("sequences", &kv_rank_state::sequences, "sorted by seq_id (a copy)")
      .def_rw("free_pages", &kv_rank_state::free_pages, "ascending (a copy)")
      .def(nb::self == nb::self)
      .def("__repr__",
           [](const kv_rank_state& s) {
             return "KvRankState(" + std::to_string(s.sequences.size()) + " sequences, " +
                    std::to_string(s.free_pages.size()) + " free pages)";
           })
      .attr("__hash__") = nb::none();

  nb::class_<kv_state>(m, "KvState",
                       "Page tables and free lists of every rank, in one mode. EP: a sequence\n"
                       "lives on one rank; TP: on every rank, with that rank's page ids.")
      .def(
          "__init__",
          [](kv_state* s, parallel_mode mode, std::vector<kv_rank_state> ranks) {
            new (s) kv_state{mode, std::move(ranks)};
          },
          nb::arg("mode") = parallel_mode::ep, nb::arg("ranks") = std::vector<kv_rank_state>{})
      .def_rw("mode", &kv_state::mode)
      .def_rw("ranks", &kv_state::ranks, "one KvRankState per rank (a copy: assign to change)")
      .def("validate", [](const kv_state& s, const kv_geometry& g) { validate(g, s); },
           nb::arg("geometry"), "Raises moebius.Error unless the state is valid for `geometry`.")
      .def("used_pages", [](const kv_state& s, const kv_geometry& g,
                            int rank) { return used_pages(g, s, rank); },
           nb::arg("geometry"), nb::arg("rank"))
      .def(nb::self == nb::self)
      .def("__repr__",
           [](const kv_state& s) {
             std::ostringstream os;
             os << "KvState(" << to_string(s.mode) << ", sequences per rank [";
             for (size_t r = 0; r < s.ranks.size(); ++r) {
               os << (r ? ", " : "") << s.ranks[r].sequences.size();
             }
             os << "])";
             return os.str();
           })
      .attr("__hash__") = nb::none();

  m.def("make_kv_state", &make_kv_state, nb::arg("geometry"), nb::arg("mode"), nb::arg("tables"),
        "A validated state whose free lists are the complement of the pages in `tables`\n"
        "(tables[r] = the KvSequence list of rank r).");

  nb::class_<kv_demand>(m, "KvDemand", "What one sequence needs on its owner (placement).")
      .def(
          "__init__",
          [](kv_demand* d, int64_t seq_id, int64_t own_pages, int64_t share_group) {
            new (d) kv_demand{seq_id, own_pages, share_group};
          },
          nb::arg("seq_id") = 0, nb::arg("own_pages") = 0, nb::arg("share_group") = -1)
      .def_rw("seq_id", &kv_demand::seq_id)
      .def_rw("own_pages", &kv_demand::own_pages)
      .def_rw("share_group", &kv_demand::share_group)
      .def("__repr__", [](const kv_demand& d) {
        return "KvDemand(seq_id=" + std::to_string(d.seq_id) +
               ", own_pages=" + std::to_string(d.own_pages) +
               ", share_group=" + std::to_string(d.share_group) + ")";
      });

  record<kv_placement> placement(
      m, "KvPlacement",
      "Owners of sequences (placement.hpp): what place_longest_first returns, and what a\n"
      "Switcher's ep_placement callable returns for TP -> EP.");
  placement.def(
      "__init__",
      [](kv_placement* p, std::vector<int> owner, std::vector<int64_t> load, bool fits,
         int64_t split_groups, double imbalance) {
        new (p) kv_placement{std::move(owner), std::move(load), fits, split_groups, imbalance};
      },
      nb::arg("owner") = std::vector<int>{}, nb::arg("load") = std::vector<int64_t>{},
      nb::arg("fits") = false, nb::arg("split_groups") = 0, nb::arg("imbalance") = 0.0);
  placement.field("owner", &kv_placement::owner, "[num demands] owning rank, -1 when not placed")
      .field("load", &kv_placement::load, "[P] pages charged to each rank")
      .field("fits", &kv_placement::fits, "every demand placed within capacity")
      .field("split_groups", &kv_placement::split_groups,
             "share groups split across owners")
      .field("imbalance", &kv_placement::imbalance, "max load / mean load (1.0 = perfect)")
      .done();

  m.def(
      "place_longest_first",
      [](const std::vector<kv_demand>& demands, const std::vector<int64_t>& group_shared_pages,
         const std::vector<int64_t>& capacity) {
        return place_longest_first(demands, group_shared_pages, capacity);
      },
      nb::arg("demands"), nb::arg("group_shared_pages"), nb::arg("capacity"),
      "Longest-first placement; returns a KvPlacement (owner, load, fits, split_groups,\n"
      "imbalance).\n"
      "capacity [10, 10], demands 6, 5, 4 pages -> owner [0, 1, 1], load [6, 9].");
  m.def(
      "kv_demands_of",
      [](const kv_geometry& g, const kv_state& s) {
        std::vector<kv_demand> demands;
        std::vector<int64_t> groups;
        kv_demands_of(g, s, demands, groups);
        return nb::make_tuple(nb::cast(demands), nb::cast(groups));
      },
      nb::arg("geometry"), nb::arg("state"),
      "(demands, group_shared_pages) of the sequences of a TP-mode state.");

  record<kv_migration_stats> stats(m, "KvMigrationStats", "What a KV migration moves.");
  stats.field("rounds", &kv_migration_stats::rounds, "plan phases")
      .field("pages_moved", &kv_migration_stats::pages_moved,
             "logical pages migrated (a shared page once, or once per owner)")
      .field("pages_in_place", &kv_migration_stats::pages_in_place,
             "pages whose owner slice stayed where it was")
      .field("pages_staged", &kv_migration_stats::pages_staged,
             "page pieces that went through staging")
      .field("pages_compacted", &kv_migration_stats::pages_compacted,
             "TP pages moved locally (aside) to free a destination")
      .field("bytes_copied", &kv_migration_stats::bytes_copied, "all bytes of all ops")
      .field("imbalance", &kv_migration_stats::imbalance,
             "TP->EP: placement max/mean load; EP->TP: 1")
      .done();

  record<kv_capacity_report> capacity(
      m, "KvCapacityReport", "Whether the target view can hold every live sequence's KV.");
  capacity.field("fits", &kv_capacity_report::fits,
                 "the target holds every live sequence AND a round fits")
      .field("holds", &kv_capacity_report::holds, "the target holds everything (no scheduling)")
      .field("rounds", &kv_capacity_report::rounds, "rounds the migration takes when it fits")
      .field("pages_needed", &kv_capacity_report::pages_needed,
             "max over ranks of pages needed in the target view")
      .field("pages_available", &kv_capacity_report::pages_available,
             "pages per rank of the target view")
      .field("reason", &kv_capacity_report::reason,
             "why not, naming the rank and the numbers; '' when it fits")
      .done();

  nb::class_<kv_migration>(m, "KvMigration", "A KV migration: its plan, tables after it, stats.")
      .def_ro("copies", &kv_migration::copies, "the plan (phases = rounds)")
      .def_ro("new_state", &kv_migration::new_state, "tables and free lists after the plan")
      .def_ro("stats", &kv_migration::stats, "a KvMigrationStats")
      .def("__repr__", [](const kv_migration& k) { return "KvMigration(" + printed(k.stats) + ")"; });

  m.def(
      "check_kv_capacity",
      [](const kv_geometry& g, const kv_state& s, parallel_mode target, int64_t staging_offset,
         int64_t staging_bytes, memory_space staging_space, int64_t max_rounds,
         const std::optional<kv_pool_layout>& layout) {
        const kv_migration_options o =
            migration_options(staging_offset, staging_bytes, staging_space, max_rounds);
        return layout ? check_kv_capacity(g, *layout, s, target, o)
                      : check_kv_capacity(g, s, target, o);
      },
      nb::arg("geometry"), nb::arg("state"), nb::arg("target"), nb::arg("staging_offset") = 0,
      nb::arg("staging_bytes") = 0, nb::arg("staging_space") = memory_space::arena,
      nb::arg("max_rounds") = 4096, nb::arg("layout") = nb::none(),
      "Whether `state` can migrate to `target` and in how many rounds (a KvCapacityReport);\n"
      "moves nothing. `layout`: the pool's KvPoolLayout (None: the present one).");
  m.def(
      "plan_kv_migration",
      [](const kv_geometry& g, const kv_state& s, parallel_mode target, int64_t staging_offset,
         int64_t staging_bytes, memory_space staging_space, int64_t max_rounds,
         const std::optional<kv_pool_layout>& layout) {
        const kv_migration_options o =
            migration_options(staging_offset, staging_bytes, staging_space, max_rounds);
        return layout ? plan_kv_migration(g, *layout, s, target, o)
                      : plan_kv_migration(g, s, target, o);
      },
      nb::arg("geometry"), nb::arg("state"), nb::arg("target"), nb::arg("staging_offset") = 0,
      nb::arg("staging_bytes") = 0, nb::arg("staging_space") = memory_space::arena,
      nb::arg("max_rounds") = 4096, nb::arg("layout") = nb::none(),
      "The migration of `state` to `target`: a plan on the kv_pool space (optionally staging\n"
      "through [staging_offset, +staging_bytes) of staging_space on every rank) and the new\n"
      "tables, over the pool's `layout` (None: the present one). Raises\n"
      "moebius.Error(code='capacity') when the target cannot hold the KV.");
  m.def(
      "plan_kv_dcp_change",
      [](const kv_geometry& g, const kv_state& s, int64_t dcp, int64_t max_rounds,
         const std::optional<kv_pool_layout>& layout) {
        kv_migration_options o;
        o.max_rounds = max_rounds;
        return layout ? plan_kv_dcp_change(g, *layout, s, dcp, o)
                      : plan_kv_dcp_change(g, s, dcp, o);
      },
      nb::arg("geometry"), nb::arg("state"), nb::arg("dcp"), nb::arg("max_rounds") = 4096,
      nb::arg("layout") = nb::none(),
      "The migration of a TP `state` of `geometry` (at geometry.dcp) to the TP view at `dcp`\n"
      "(kv/dcp_change.hpp): each rank keeps its share at dcp lcm(a, b), drops what it held only\n"
      "at a and receives what it holds only at b, in at most 2 rounds, never staged; new_state\n"
      "is valid for with_dcp(geometry, dcp). An EP state or the same dcp: no phase. Raises\n"
      "moebius.Error(code='invalid_argument') for a dcp the geometry does not allow, and\n"
      "code='capacity' when the target cannot hold the KV.");
  m.def("kv_staging_slot_bytes", &kv_staging_slot_bytes, nb::arg("geometry"), nb::arg("target"),
        "Bytes of one staging slot: num_tensors * page_bytes(target).");
}

}  // namespace moebius::python
