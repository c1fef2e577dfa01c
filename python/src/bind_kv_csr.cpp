// Page tables as arrays: one rank's tables in and out in CSR form, the shape FlashInfer's paged
// kernels take (BatchDecodeWithPagedKVCacheWrapper.plan: paged_kv_indptr [batch + 1],
// paged_kv_indices [indptr[-1]], paged_kv_last_page_len [batch]; int32 or int64), so an
// engine never walks Python lists of ints.
//
//   rank 0 holds seq 4 (pages {7, 2}, 20 tokens) and seq 9 (pages {5}, 3 tokens), page_size 16:
//   seq_ids [4, 9], indptr [0, 2, 3], indices [7, 2, 5], last_page_len [4, 3]
//
// The four arrays travel together as a KvCsr (one rank's tables; make_kv_state_from_csr takes
// a list of them). In: any 1-D int32 or int64 object with __dlpack__ on the CPU (numpy, torch
// CPU or pinned tensors), read in place through its strides: no conversion, no intermediate
// copy. Out: either new numpy arrays (one allocation each, handed to numpy without a second
// copy), or written straight into the caller's arrays (csr_into: e.g. the fixed pinned buffers
// an engine copies to the device before replaying a CUDA graph).

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common.hpp"

namespace moebius::python {
namespace {

// One rank's page tables as arrays (KvCsr): what csr() returns and make_kv_state_from_csr
// reads. Arrays of any library: numpy out of csr(), torch tensors out of moebius.torch.kv_csr.
struct csr_arrays {
  nb::object seq_ids, indptr, indices, last_page_len;
  nb::object shared_prefix_pages = nb::none(), prefill_cursor = nb::none();  // optional rows
};

// The element width of a CSR array, from "int32"/"int64", numpy (np.int32, np.dtype) or torch
// (torch.int32) spellings.
bool is_wide_dtype(nb::handle dtype) {
  // str() of each spelling ends in the name: "int32", "torch.int32", "<class 'numpy.int32'>".
  std::string name = nb::cast<std::string>(nb::str(dtype));
  if (name.size() > 2 && name.compare(name.size() - 2, 2, "'>") == 0) name.resize(name.size() - 2);
  if (const size_t dot = name.rfind('.'); dot != std::string::npos) name = name.substr(dot + 1);
  if (name == "int64") return true;
  MOEBIUS_CHECK(name == "int32", errc::invalid_argument,
                "page-table arrays are int32 or int64 (FlashInfer's index types), got '",
                nb::cast<std::string>(nb::str(dtype)), "'");
  return false;
}

// A 1-D integer array on the CPU, read or written in place through its stride.
struct index_array {
  std::byte* data = nullptr;
  int64_t size = 0;
  int64_t stride = 1;  // elements
  bool wide = false;   // int64 (else int32)
  nb::object owner;    // the DLPack import (keeps the bytes alive while we read)

  int64_t operator[](int64_t i) const {
    const std::byte* p = data + i * stride * (wide ? 8 : 4);
    if (wide) {
      int64_t v;
      std::memcpy(&v, p, 8);
      return v;
    }
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  void set(int64_t i, int64_t v) const {
    std::byte* p = data + i * stride * (wide ? 8 : 4);
    if (wide) {
      std::memcpy(p, &v, 8);
    } else {
      const auto n = static_cast<int32_t>(v);  // range checked by the caller
      std::memcpy(p, &n, 4);
    }
  }
};

// `obj` as an index_array. nb::ndarray<> without nb::ro refuses read-only arrays, so `writable`
// arrays are checked by the cast itself; read-only arrays are fine to read.
index_array index_array_of(nb::handle obj, const char* name, bool writable) {
  index_array a;
  auto describe = [&] { return nb::cast<std::string>(nb::str(nb::handle(obj.type()))); };
  auto fill = [&](const auto& array) {
    MOEBIUS_CHECK(array.ndim() == 1, errc::invalid_argument, name, " must be 1-D, got ",
                  array.ndim(), " dimensions");
    MOEBIUS_CHECK(array.device_type() == dl_cpu || array.device_type() == dl_cuda_host,
                  errc::invalid_argument, name,
                  " must be in host memory (CPU or pinned); copy device tables with "
                  ".to('cpu') or write them into a pinned buffer; got DLPack device type ",
                  array.device_type());
    const nb::dlpack::dtype t = array.dtype();
    MOEBIUS_CHECK(t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int) && t.lanes == 1 &&
                      (t.bits == 32 || t.bits == 64),
                  errc::invalid_argument, name,
                  " must hold int32 or int64 (FlashInfer's index types), got DLPack dtype code ",
                  int(t.code), " with ", int(t.bits), " bits");
    a.data = static_cast<std::byte*>(const_cast<void*>(static_cast<const void*>(array.data())));
    a.size = static_cast<int64_t>(array.shape(0));
    a.stride = a.size > 1 ? array.stride(0) : 1;
    a.wide = t.bits == 64;
    a.owner = nb::cast(array);
  };
  if (writable) {
    nb::ndarray<> array;
    MOEBIUS_CHECK(nb::try_cast(obj, array, /*convert=*/false), errc::invalid_argument, name,
                  " must be a writable 1-D int32/int64 array with __dlpack__ (numpy, torch), got ",
                  describe());
    fill(array);
  } else {
    nb::ndarray<nb::ro> array;
    MOEBIUS_CHECK(nb::try_cast(obj, array, /*convert=*/false), errc::invalid_argument, name,
                  " must be a 1-D int32/int64 array with __dlpack__ (numpy, torch), got ",
                  describe());
    fill(array);
  }
  return a;
}

// The rows of `rank`: every sequence in seq_id order, or those named by `seq_ids` in its order
// (the engine's batch order).
std::vector<const kv_sequence*> rows_of(const kv_rank_state& rank, nb::handle seq_ids) {
  std::vector<const kv_sequence*> rows;
  if (seq_ids.is_none()) {
    for (const kv_sequence& s : rank.sequences) rows.push_back(&s);
    return rows;
  }
  const index_array ids = index_array_of(seq_ids, "seq_ids", false);
  rows.reserve(static_cast<size_t>(ids.size));
  for (int64_t i = 0; i < ids.size; ++i) {
    const int64_t id = ids[i];
    auto it = std::lower_bound(rank.sequences.begin(), rank.sequences.end(), id,
                               [](const kv_sequence& s, int64_t v) { return s.seq_id < v; });
    MOEBIUS_CHECK(it != rank.sequences.end() && it->seq_id == id, errc::invalid_argument,
                  "seq_ids[", i, "] = ", id, " is not a sequence of this rank (",
                  rank.sequences.size(), " sequences)");
    rows.push_back(&*it);
  }
  return rows;
}

struct csr_sizes {
  int64_t rows = 0;
  int64_t nnz = 0;
  int64_t max_value = 0;  // the largest page id or seq id written
};

csr_sizes sizes_of(const std::vector<const kv_sequence*>& rows) {
  csr_sizes s;
  s.rows = static_cast<int64_t>(rows.size());
  for (const kv_sequence* q : rows) {
    s.nnz += q->num_pages();
    s.max_value = std::max(s.max_value, q->seq_id);
    for (int64_t p : q->pages) s.max_value = std::max(s.max_value, p);
  }
  s.max_value = std::max(s.max_value, s.nnz);  // indptr's last entry
  return s;
}

void check_fits_int32(const csr_sizes& s, bool wide) {
  MOEBIUS_CHECK(wide || s.max_value <= std::numeric_limits<int32_t>::max(), errc::overflow,
                "page-table value ", s.max_value, " does not fit int32: ask for int64");
}

// Writes the four arrays (each at least as long as the layout needs; checked by the callers).
void write_csr(const std::vector<const kv_sequence*>& rows, const index_array* seq_ids,
               const index_array& indptr, const index_array& indices,
               const index_array& last_page_len) {
  int64_t at = 0;
  indptr.set(0, 0);
  for (size_t i = 0; i < rows.size(); ++i) {
    const kv_sequence& q = *rows[i];
    if (seq_ids) seq_ids->set(static_cast<int64_t>(i), q.seq_id);
    for (int64_t p : q.pages) indices.set(at++, p);
    indptr.set(static_cast<int64_t>(i) + 1, at);
    last_page_len.set(static_cast<int64_t>(i), q.last_page_len);
  }
}

using numpy_index = nb::ndarray<nb::numpy, nb::ndim<1>>;

// A fresh array of n elements owned by numpy (the capsule frees it): the one copy out.
std::pair<numpy_index, index_array> new_index_array(int64_t n, bool wide) {
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * (wide ? 8 : 4);
  std::unique_ptr<std::byte[]> buffer(new std::byte[bytes]);
  std::byte* data = buffer.get();
  nb::capsule owner(buffer.release(),
                    [](void* p) noexcept { delete[] static_cast<std::byte*>(p); });
  const size_t shape[1] = {static_cast<size_t>(n)};
  const nb::dlpack::dtype t{static_cast<uint8_t>(nb::dlpack::dtype_code::Int),
                            static_cast<uint8_t>(wide ? 64 : 32), 1};
  numpy_index array(data, 1, shape, owner, nullptr, t);
  index_array view;
  view.data = data;
  view.size = n;
  view.wide = wide;
  return {std::move(array), view};
}

csr_arrays csr_of(const kv_rank_state& rank, nb::handle dtype, nb::handle seq_ids) {
  const bool wide = is_wide_dtype(dtype);
  const std::vector<const kv_sequence*> rows = rows_of(rank, seq_ids);
  const csr_sizes s = sizes_of(rows);
  check_fits_int32(s, wide);
  auto [ids, ids_view] = new_index_array(s.rows, wide);
  auto [indptr, indptr_view] = new_index_array(s.rows + 1, wide);
  auto [indices, indices_view] = new_index_array(s.nnz, wide);
  auto [last, last_view] = new_index_array(s.rows, wide);
  write_csr(rows, &ids_view, indptr_view, indices_view, last_view);
  return csr_arrays{nb::cast(std::move(ids)), nb::cast(std::move(indptr)),
                    nb::cast(std::move(indices)), nb::cast(std::move(last))};
}

nb::tuple csr_into(const kv_rank_state& rank, nb::handle indptr, nb::handle indices,
                   nb::handle last_page_len, nb::handle seq_ids, nb::handle out_seq_ids) {
  const std::vector<const kv_sequence*> rows = rows_of(rank, seq_ids);
  const csr_sizes s = sizes_of(rows);
  const index_array p = index_array_of(indptr, "indptr", true);
  const index_array i = index_array_of(indices, "indices", true);
  const index_array l = index_array_of(last_page_len, "last_page_len", true);
  std::optional<index_array> o;
  if (!out_seq_ids.is_none()) o = index_array_of(out_seq_ids, "out_seq_ids", true);
  MOEBIUS_CHECK(p.size >= s.rows + 1 && l.size >= s.rows && i.size >= s.nnz &&
                    (!o || o->size >= s.rows),
                errc::out_of_range, "csr_into: ", s.rows, " sequences with ", s.nnz,
                " pages need indptr >= ", s.rows + 1, ", last_page_len and seq_ids >= ", s.rows,
                ", indices >= ", s.nnz, " elements; got ", p.size, ", ", l.size, ", ",
                o ? o->size : s.rows, ", ", i.size, ": enlarge the buffers");
  for (const index_array* a : {&p, &i, &l}) check_fits_int32(s, a->wide);
  if (o) check_fits_int32(s, o->wide);
  write_csr(rows, o ? &*o : nullptr, p, i, l);
  return nb::make_tuple(s.rows, s.nnz);
}

// One rank's sequences from CSR arrays; num_tokens from page_size. Optional per-row arrays
// (shared_prefix_pages, prefill_cursor) may be None (zeros).
std::vector<kv_sequence> sequences_from_csr(int64_t page_size, nb::handle seq_ids,
                                            nb::handle indptr, nb::handle indices,
                                            nb::handle last_page_len, nb::handle shared,
                                            nb::handle cursor) {
  const index_array ids = index_array_of(seq_ids, "seq_ids", false);
  const index_array p = index_array_of(indptr, "indptr", false);
  const index_array i = index_array_of(indices, "indices", false);
  const index_array l = index_array_of(last_page_len, "last_page_len", false);
  std::optional<index_array> sh, cu;
  if (!shared.is_none()) sh = index_array_of(shared, "shared_prefix_pages", false);
  if (!cursor.is_none()) cu = index_array_of(cursor, "prefill_cursor", false);
  const int64_t n = ids.size;
  MOEBIUS_CHECK(p.size == n + 1 && l.size == n && (!sh || sh->size == n) && (!cu || cu->size == n),
                errc::invalid_argument, "CSR tables of ", n,
                " sequences need indptr of n + 1 = ", n + 1,
                " and last_page_len (and shared_prefix_pages, prefill_cursor) of n elements; got ",
                p.size, ", ", l.size);
  MOEBIUS_CHECK(n == 0 || (p[0] == 0 && p[n] == i.size), errc::invalid_argument,
                "indptr must start at 0 and end at len(indices) = ", i.size, "; got ",
                n ? p[0] : 0, " .. ", n ? p[n] : 0);
  // The whole of indptr before any row is read: a row whose end runs past indices (a later
  // row decreasing) must not read beyond it, nor size a table from it.
  for (int64_t r = 0; r < n; ++r) {
    MOEBIUS_CHECK(p[r] <= p[r + 1], errc::invalid_argument, "indptr must not decrease: indptr[",
                  r, "] = ", p[r], " > indptr[", r + 1, "] = ", p[r + 1]);
  }
  std::vector<kv_sequence> out(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    const int64_t begin = p[r], end = p[r + 1];  // 0 <= begin <= end <= len(indices)
    kv_sequence& q = out[static_cast<size_t>(r)];
    q.seq_id = ids[r];
    q.last_page_len = l[r];
    q.num_tokens = (end - begin - 1) * page_size + q.last_page_len;
    q.shared_prefix_pages = sh ? (*sh)[r] : 0;
    q.prefill_cursor = cu ? (*cu)[r] : 0;
    q.pages.resize(static_cast<size_t>(end - begin));
    for (int64_t k = begin; k < end; ++k) q.pages[static_cast<size_t>(k - begin)] = i[k];
  }
  return out;  // make_kv_state validates (page range, last_page_len, uniqueness, ...)
}

const kv_rank_state& rank_of(const kv_state& s, int rank) {
  MOEBIUS_CHECK(rank >= 0 && static_cast<size_t>(rank) < s.ranks.size(), errc::out_of_range,
                "rank ", rank, " outside [0, ", s.ranks.size(), ")");
  return s.ranks[static_cast<size_t>(rank)];
}

constexpr const char* csr_doc =
    "This rank's page tables in CSR form (FlashInfer's paged_kv_indptr, paged_kv_indices,\n"
    "paged_kv_last_page_len): a KvCsr of new numpy arrays (seq_ids, indptr, indices,\n"
    "last_page_len) of `dtype` ('int32' or 'int64', numpy or torch spelling). Rows are every\n"
    "sequence in seq_id order, or the sequences named by `seq_ids` (an int array: the\n"
    "batch order) in that order. Raises moebius.Error(code='overflow') when a value does not\n"
    "fit int32.";

constexpr const char* csr_into_doc =
    "Writes the CSR tables into the caller's arrays (1-D int32/int64 with __dlpack__ in host\n"
    "memory: numpy, torch CPU or pinned tensors; each may have its own dtype) in place, and\n"
    "returns (rows, nnz): indptr[:rows + 1], indices[:nnz], last_page_len[:rows] (and\n"
    "out_seq_ids[:rows]) are written, the rest is untouched. Rows as in csr().";

// Adds method `name` to the bound class `cls` (bound in another file of the module).
template <class F, class... Extra>
void def_method(nb::handle cls, const char* name, F&& f, const Extra&... extra) {
  nb::cpp_function_def(std::forward<F>(f), nb::scope(cls), nb::name(name), nb::is_method(),
                       extra...);
}

}  // namespace

void bind_kv_csr(nb::module_& m) {
  record<csr_arrays> csr(
      m, "KvCsr",
      "One rank's page tables as arrays, FlashInfer's CSR form: seq_ids [batch], indptr\n"
      "[batch + 1], indices [indptr[-1]] (page ids), last_page_len [batch], and optionally\n"
      "shared_prefix_pages and prefill_cursor [batch] (None: zeros). 1-D int32/int64 arrays\n"
      "of any library (numpy, torch).\n"
      "  seq 4 pages {7, 2} 20 tokens, seq 9 pages {5} 3 tokens, page_size 16:\n"
      "  KvCsr(seq_ids=[4, 9], indptr=[0, 2, 3], indices=[7, 2, 5], last_page_len=[4, 3])");
  csr.def(
      "__init__",
      [](csr_arrays* c, nb::object seq_ids, nb::object indptr, nb::object indices,
         nb::object last_page_len, nb::object shared_prefix_pages, nb::object prefill_cursor) {
        new (c) csr_arrays{std::move(seq_ids),        std::move(indptr),
                           std::move(indices),        std::move(last_page_len),
                           std::move(shared_prefix_pages), std::move(prefill_cursor)};
      },
      nb::arg("seq_ids"), nb::arg("indptr"), nb::arg("indices"), nb::arg("last_page_len"),
      nb::arg("shared_prefix_pages") = nb::none(), nb::arg("prefill_cursor") = nb::none());
  csr.field_rw("seq_ids", &csr_arrays::seq_ids, "row i's sequence id")
      .field_rw("indptr", &csr_arrays::indptr, "row i's pages are indices[indptr[i]:indptr[i+1]]")
      .field_rw("indices", &csr_arrays::indices, "page ids in token order, row after row")
      .field_rw("last_page_len", &csr_arrays::last_page_len, "tokens in row i's last page")
      .field_rw("shared_prefix_pages", &csr_arrays::shared_prefix_pages, "optional; None: 0")
      .field_rw("prefill_cursor", &csr_arrays::prefill_cursor, "optional; None: 0")
      .done(/*comparable=*/false);  // arrays compare element-wise: compare the fields

  const nb::handle rank_state = m.attr("KvRankState");
  const nb::handle state = m.attr("KvState");
  const nb::handle sw = m.attr("Switcher");
  const nb::handle progressive = m.attr("ProgressiveSwitch");
  const nb::str i32("int32");

  def_method(
      rank_state, "csr",
      [](const kv_rank_state& r, nb::handle dtype, nb::handle seq_ids) {
        return csr_of(r, dtype, seq_ids);
      },
      nb::arg("dtype") = i32, nb::arg("seq_ids") = nb::none(), csr_doc);
  def_method(
      rank_state, "csr_into",
      [](const kv_rank_state& r, nb::handle indptr, nb::handle indices, nb::handle last,
         nb::handle seq_ids, nb::handle out_seq_ids) {
        return csr_into(r, indptr, indices, last, seq_ids, out_seq_ids);
      },
      nb::arg("indptr"), nb::arg("indices"), nb::arg("last_page_len"), nb::kw_only(),
      nb::arg("seq_ids") = nb::none(), nb::arg("out_seq_ids") = nb::none(), csr_into_doc);

  def_method(
      state, "csr",
      [](const kv_state& s, int rank, nb::handle dtype, nb::handle seq_ids) {
        return csr_of(rank_of(s, rank), dtype, seq_ids);
      },
      nb::arg("rank"), nb::arg("dtype") = i32, nb::arg("seq_ids") = nb::none(),
      "KvRankState.csr of rank `rank`, without copying the state's other ranks.");
  def_method(
      state, "csr_into",
      [](const kv_state& s, int rank, nb::handle indptr, nb::handle indices, nb::handle last,
         nb::handle seq_ids, nb::handle out_seq_ids) {
        return csr_into(rank_of(s, rank), indptr, indices, last, seq_ids, out_seq_ids);
      },
      nb::arg("rank"), nb::arg("indptr"), nb::arg("indices"), nb::arg("last_page_len"),
      nb::kw_only(), nb::arg("seq_ids") = nb::none(), nb::arg("out_seq_ids") = nb::none(),
      "KvRankState.csr_into of rank `rank`.");

  // The switcher's and a progressive switch's tables, read where they are (no state copy).
  def_method(
      sw, "kv_csr",
      [](const switcher& s, int rank, nb::handle dtype, nb::handle seq_ids) {
        return csr_of(rank_of(s.kv_tables(), rank), dtype, seq_ids);
      },
      nb::arg("rank"), nb::arg("dtype") = i32, nb::arg("seq_ids") = nb::none(),
      "KvState.csr of the switcher's tables (the current mode's), without copying them.");
  def_method(
      sw, "kv_csr_into",
      [](const switcher& s, int rank, nb::handle indptr, nb::handle indices, nb::handle last,
         nb::handle seq_ids, nb::handle out_seq_ids) {
        return csr_into(rank_of(s.kv_tables(), rank), indptr, indices, last, seq_ids,
                        out_seq_ids);
      },
      nb::arg("rank"), nb::arg("indptr"), nb::arg("indices"), nb::arg("last_page_len"),
      nb::kw_only(), nb::arg("seq_ids") = nb::none(), nb::arg("out_seq_ids") = nb::none(),
      "KvState.csr_into of the switcher's tables.");
  def_method(
      progressive, "kv_csr",
      [](const progressive_switch& p, parallel_mode mode, int rank, nb::handle dtype,
         nb::handle seq_ids) {
        return csr_of(rank_of(p.view().tables(mode), rank), dtype, seq_ids);
      },
      nb::arg("mode"), nb::arg("rank"), nb::arg("dtype") = i32, nb::arg("seq_ids") = nb::none(),
      "KvState.csr of the frozen tables that layers in `mode` read during the switch.");

  m.def(
      "make_kv_state_from_csr",
      [](const kv_geometry& g, parallel_mode mode, const std::vector<const csr_arrays*>& tables) {
        std::vector<std::vector<kv_sequence>> all;
        all.reserve(tables.size());
        for (const csr_arrays* t : tables) {
          MOEBIUS_CHECK(t != nullptr, errc::invalid_argument,
                        "make_kv_state_from_csr: each rank's tables are a KvCsr, got None");
          all.push_back(sequences_from_csr(g.page_size, t->seq_ids, t->indptr, t->indices,
                                           t->last_page_len, t->shared_prefix_pages,
                                           t->prefill_cursor));
        }
        return make_kv_state(g, mode, std::move(all));
      },
      nb::arg("geometry"), nb::arg("mode"), nb::arg("tables"),
      "A validated KvState from CSR tables: tables[r] is rank r's KvCsr (1-D int32/int64 host\n"
      "arrays: numpy, torch; what csr() returns), read in place; num_tokens = (pages - 1) *\n"
      "page_size + last_page_len; free lists are the complement of the pages in use.");
}

}  // namespace moebius::python
