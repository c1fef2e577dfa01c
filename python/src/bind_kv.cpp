// The paged KV cache: geometry, page tables, placement and migration (kv/).

#include <nanobind/operators.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.hpp"

namespace moebius::python {

nb::dict to_dict(const kv_migration_stats& s) {
  nb::dict d;
  d["rounds"] = s.rounds;
  d["pages_moved"] = s.pages_moved;
  d["pages_in_place"] = s.pages_in_place;
  d["pages_staged"] = s.pages_staged;
  d["pages_compacted"] = s.pages_compacted;
  d["bytes_copied"] = s.bytes_copied;
  d["imbalance"] = s.imbalance;
  return d;
}

nb::dict to_dict(const kv_capacity_report& r) {
  nb::dict d;
  d["fits"] = r.fits;
  d["holds"] = r.holds;
  d["rounds"] = r.rounds;
  d["pages_needed"] = r.pages_needed;
  d["pages_available"] = r.pages_available;
  d["reason"] = r.reason;
  return d;
}

nb::dict to_dict(const kv_placement& p) {
  nb::dict d;
  d["owner"] = nb::cast(p.owner);
  d["load"] = nb::cast(p.load);
  d["fits"] = p.fits;
  d["split_groups"] = p.split_groups;
  d["imbalance"] = p.imbalance;
  return d;
}

namespace {

kv_migration_options migration_options(int64_t staging_offset, int64_t staging_bytes,
                                       memory_space staging_space, int64_t max_rounds) {
  kv_migration_options o;
  o.staging = kv_staging{staging_space, staging_offset, staging_bytes};
  o.max_rounds = max_rounds;
  return o;
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

  m.def("make_kv_geometry", &make_kv_geometry, nb::arg("num_layers"), nb::arg("num_kv_heads"),
        nb::arg("head_dim"), nb::arg("page_size"), nb::arg("num_ep_pages"), nb::arg("num_ranks"),
        nb::arg("type") = dtype::bf16, nb::arg("layout") = kv_layout::hnd,
        "Builds and validates a KV geometry.\n"
        "Qwen3-235B, 64 pages, P=8: make_kv_geometry(94, 4, 128, 16, 64, 8).");
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

  m.def(
      "place_longest_first",
      [](const std::vector<kv_demand>& demands, const std::vector<int64_t>& group_shared_pages,
         const std::vector<int64_t>& capacity) {
        return to_dict(place_longest_first(demands, group_shared_pages, capacity));
      },
      nb::arg("demands"), nb::arg("group_shared_pages"), nb::arg("capacity"),
      "Longest-first placement; returns {owner, load, fits, split_groups, imbalance}.\n"
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

  nb::class_<kv_migration>(m, "KvMigration", "A KV migration: its plan, tables after it, stats.")
      .def_ro("copies", &kv_migration::copies, "the plan (phases = rounds)")
      .def_ro("new_state", &kv_migration::new_state, "tables and free lists after the plan")
      .def_prop_ro("stats", [](const kv_migration& k) { return to_dict(k.stats); })
      .def("__repr__", [](const kv_migration& k) { return "KvMigration(" + printed(k.stats) + ")"; });

  m.def(
      "check_kv_capacity",
      [](const kv_geometry& g, const kv_state& s, parallel_mode target, int64_t staging_offset,
         int64_t staging_bytes, memory_space staging_space, int64_t max_rounds) {
        return to_dict(check_kv_capacity(
            g, s, target, migration_options(staging_offset, staging_bytes, staging_space, max_rounds)));
      },
      nb::arg("geometry"), nb::arg("state"), nb::arg("target"), nb::arg("staging_offset") = 0,
      nb::arg("staging_bytes") = 0, nb::arg("staging_space") = memory_space::arena,
      nb::arg("max_rounds") = 4096,
      "Whether `state` can migrate to `target` and in how many rounds; moves nothing.\n"
      "Returns {fits, holds, rounds, pages_needed, pages_available, reason}.");
  m.def(
      "plan_kv_migration",
      [](const kv_geometry& g, const kv_state& s, parallel_mode target, int64_t staging_offset,
         int64_t staging_bytes, memory_space staging_space, int64_t max_rounds) {
        return plan_kv_migration(
            g, s, target, migration_options(staging_offset, staging_bytes, staging_space, max_rounds));
      },
      nb::arg("geometry"), nb::arg("state"), nb::arg("target"), nb::arg("staging_offset") = 0,
      nb::arg("staging_bytes") = 0, nb::arg("staging_space") = memory_space::arena,
      nb::arg("max_rounds") = 4096,
      "The migration of `state` to `target`: a plan on the kv_pool space (optionally staging\n"
      "through [staging_offset, +staging_bytes) of staging_space on every rank) and the new\n"
      "tables. Raises moebius.Error(code='capacity') when the target cannot hold the KV.");
  m.def("kv_staging_slot_bytes", &kv_staging_slot_bytes, nb::arg("geometry"), nb::arg("target"),
        "Bytes of one staging slot: num_tensors * page_bytes(target).");
}

}  // namespace moebius::python
