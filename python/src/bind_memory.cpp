// Memory in (DLPack objects or (pointer, bytes, device) tuples) and views out (DLPack tensors
// at fixed addresses inside a rank's arena and KV pool).

#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include "common.hpp"

namespace moebius::python {

memory_span memory_span_of(nb::handle obj, int& device, nb::object& owner) {
  if (nb::isinstance<nb::tuple>(obj)) {
    const nb::tuple t = nb::borrow<nb::tuple>(obj);
    MOEBIUS_CHECK(t.size() == 3, errc::invalid_argument,
                  "memory as a tuple must be (pointer, bytes, device), got ", t.size(), " items");
    const auto pointer = nb::cast<uintptr_t>(t[0]);
    const auto bytes = nb::cast<int64_t>(t[1]);
    device = nb::cast<int>(t[2]);
    MOEBIUS_CHECK(device >= host_memory_device, errc::invalid_argument,
                  "memory device must be -1 (host) or a CUDA ordinal, got ", device);
    owner = nb::none();
    return memory_span(reinterpret_cast<void*>(pointer), bytes);
  }
  // No conversion: an implicit copy would hand the transport a temporary.
  nb::ndarray<> array;
  MOEBIUS_CHECK(nb::try_cast(obj, array, /*convert=*/false), errc::invalid_argument,
                "memory must be a writable object with __dlpack__ (numpy, torch, ...) or a "
                "(pointer, bytes, device) tuple, got ",
                nb::str(nb::handle(obj.type())).c_str());
  int64_t expected = 1;
  for (size_t d = array.ndim(); d-- > 0;) {
    MOEBIUS_CHECK(array.shape(d) <= 1 || array.stride(d) == expected, errc::invalid_argument,
                  "memory must be C-contiguous: dimension ", d, " has stride ", array.stride(d),
                  " elements, expected ", expected);
    expected *= static_cast<int64_t>(array.shape(d));
  }
  switch (array.device_type()) {
    case dl_cpu:
    case dl_cuda_host: device = host_memory_device; break;
    case dl_cuda: device = array.device_id(); break;
    default:
      MOEBIUS_FAIL(errc::invalid_argument, "memory on DLPack device type ", array.device_type(),
                   " is neither host nor CUDA memory");
  }
  owner = nb::cast(array);
  return memory_span(const_cast<void*>(array.data()), static_cast<int64_t>(array.nbytes()));
}

std::vector<rank_memory> rank_memories_of(const std::vector<nb::handle>& ranks) {
  std::vector<rank_memory> memory;
  memory.reserve(ranks.size());
  for (nb::handle r : ranks) memory.push_back(nb::cast<const py_rank_memory&>(r).memory);
  return memory;
}

namespace {

// DLPack dtype of a Moebius element type; `raw` gives the unsigned integer of the same width
// (numpy has no bfloat16 or float8).
nb::dlpack::dtype dl_dtype_of(dtype t, bool raw) {
  using code = nb::dlpack::dtype_code;
  const auto bits = static_cast<uint8_t>(dtype_bytes(t) * 8);
  if (raw) return {static_cast<uint8_t>(code::UInt), bits, 1};
  switch (t) {
    case dtype::bf16: return {static_cast<uint8_t>(code::Bfloat), 16, 1};
    case dtype::fp16:
    case dtype::fp32: return {static_cast<uint8_t>(code::Float), bits, 1};
    case dtype::fp8_e4m3: return {static_cast<uint8_t>(code::Float8_E4M3FN), 8, 1};
    case dtype::fp8_e5m2: return {static_cast<uint8_t>(code::Float8_E5M2), 8, 1};
  }
  MOEBIUS_FAIL(errc::internal, "unknown dtype");
}

// A tensor of `shape` (C-contiguous, `t` elements) at `offset` bytes into space `s` of `mem`,
// kept alive by `owner` (the RankMemory object).
// nb::array_api: an object with __dlpack__ and __dlpack_device__ (torch/numpy/cupy.from_dlpack).
using dlpack_tensor = nb::ndarray<nb::array_api>;

dlpack_tensor view_of(const py_rank_memory& mem, nb::handle owner, memory_space s, int64_t offset,
                      const std::vector<size_t>& shape, dtype t, bool raw) {
  const memory_span& span = mem.memory.space(s);
  int64_t bytes = dtype_bytes(t);
  for (size_t n : shape) bytes *= static_cast<int64_t>(n);
  MOEBIUS_CHECK(offset >= 0 && offset + bytes <= span.bytes, errc::out_of_range,
                "view [", offset, ", ", offset + bytes, ") lies outside the ", to_string(s),
                " of ", span.bytes, " bytes");
  return dlpack_tensor(span.data() + offset, shape.size(), shape.data(), owner, nullptr,
                       dl_dtype_of(t, raw), mem.on_device() ? dl_cuda : dl_cpu,
                       mem.on_device() ? mem.memory.device : 0);
}

}  // namespace

void bind_memory(nb::module_& m) {
  nb::class_<py_rank_memory>(
      m, "RankMemory",
      "One rank's memory: its expert arena and (optionally) its KV pool.\n\n"
      "Each space is an object with __dlpack__ (numpy array, torch tensor; C-contiguous and\n"
      "writable; any dtype, its bytes are used) or a (pointer, bytes, device) tuple with\n"
      "device -1 for host memory. DLPack imports are kept alive by this object and by every\n"
      "view taken from it; with a tuple the caller keeps the memory alive. Both spaces must be\n"
      "on the same device.")
      .def(
          "__init__",
          [](py_rank_memory* self, nb::handle arena, nb::handle kv_pool) {
            py_rank_memory mem;
            int arena_device = host_memory_device;
            mem.memory.space(memory_space::arena) =
                memory_span_of(arena, arena_device, mem.owners[0]);
            mem.memory.device = arena_device;
            if (!kv_pool.is_none()) {
              int kv_device = host_memory_device;
              mem.memory.space(memory_space::kv_pool) =
                  memory_span_of(kv_pool, kv_device, mem.owners[1]);
              MOEBIUS_CHECK(kv_device == arena_device, errc::invalid_argument,
                            "arena (device ", arena_device, ") and KV pool (device ", kv_device,
                            ") of one rank must be on the same device");
            } else {
              mem.owners[1] = nb::none();
            }
            new (self) py_rank_memory(std::move(mem));
          },
          nb::arg("arena"), nb::arg("kv_pool") = nb::none())
      .def_prop_ro("device", [](const py_rank_memory& m) { return m.memory.device; },
                   "CUDA ordinal, or -1 for host memory")
      .def_prop_ro("arena_ptr", [](const py_rank_memory& m) {
        return reinterpret_cast<uintptr_t>(m.memory.space(memory_space::arena).base);
      })
      .def_prop_ro("arena_bytes",
                   [](const py_rank_memory& m) { return m.memory.space(memory_space::arena).bytes; })
      .def_prop_ro("kv_pool_ptr", [](const py_rank_memory& m) {
        return reinterpret_cast<uintptr_t>(m.memory.space(memory_space::kv_pool).base);
      })
      .def_prop_ro("kv_pool_bytes", [](const py_rank_memory& m) {
        return m.memory.space(memory_space::kv_pool).bytes;
      })
      .def(
          "weight_view",
          [](nb::handle_t<py_rank_memory> self, const arena_geometry& g, int64_t layer,
             parallel_mode mode, weight_tensor t, bool raw) {
            const py_rank_memory& mem = nb::cast<const py_rank_memory&>(self);
            MOEBIUS_CHECK(layer >= 0 && layer < g.shape.num_layers, errc::out_of_range, "layer ",
                          layer, " outside [0, ", g.shape.num_layers, ")");
            const tensor_geometry tg = geometry_of(g.shape, t);
            MOEBIUS_CHECK(tg.bytes() > 0, errc::invalid_argument, "tensor ", to_string(t),
                          " is absent from ", g.shape, " (no block scales)");
            const layout3 l = mode == parallel_mode::ep
                                  ? make_view<parallel_mode::ep>(g.shape, t, g.num_ranks).local_layout()
                                  : make_view<parallel_mode::tp>(g.shape, t, g.num_ranks).local_layout();
            const bool scale = t == weight_tensor::w13_scale || t == weight_tensor::w2_scale;
            return view_of(mem, self, memory_space::arena, g.tensor_base(mode, layer, t),
                           {static_cast<size_t>(l.shape[0]), static_cast<size_t>(l.shape[1]),
                            static_cast<size_t>(l.shape[2])},
                           scale ? g.shape.scale_dtype : g.shape.weight_dtype, raw);
          },
          nb::arg("geometry"), nb::arg("layer"), nb::arg("mode"),
          nb::arg("tensor") = weight_tensor::w13, nb::arg("raw") = false,
          "Tensor `tensor` of `layer` as this rank holds it in `mode`, at its fixed address in\n"
          "the arena (a DLPack tensor: torch.from_dlpack / numpy.from_dlpack):\n"
          "  w13 EP [E/P, 2I, H], TP [E, 2I/P, H] (gate slice then up slice);\n"
          "  w2  EP [E/P, H, I],  TP [E, H, I/P].\n"
          "Its dtype is the shape's (bf16 as DLPack bfloat16); raw=True gives the unsigned\n"
          "integer of the same width (for numpy, which has no bfloat16).")
      .def(
          "kv_pool_view",
          [](nb::handle_t<py_rank_memory> self, const kv_geometry& g, parallel_mode mode,
             bool raw) {
            const py_rank_memory& mem = nb::cast<const py_rank_memory&>(self);
            const auto heads = static_cast<size_t>(mode == parallel_mode::ep
                                                       ? g.heads_per_ep_page()
                                                       : g.heads_per_tp_page());
            const auto tokens = static_cast<size_t>(g.page_size);
            std::vector<size_t> shape = {static_cast<size_t>(g.num_layers),
                                         static_cast<size_t>(g.kv_tensors()),
                                         static_cast<size_t>(g.num_pages(mode))};
            if (g.layout == kv_layout::hnd) {
              shape.insert(shape.end(), {heads, tokens});
            } else {
              shape.insert(shape.end(), {tokens, heads});
            }
            shape.push_back(static_cast<size_t>(g.head_dim));
            return view_of(mem, self, memory_space::kv_pool, 0, shape, g.type, raw);
          },
          nb::arg("geometry"), nb::arg("mode"), nb::arg("raw") = false,
          "The KV pool as `mode` reads it, at its fixed address:\n"
          "  HND [L, 2 (K, V), pages, heads, page_size, head_dim]\n"
          "  NHD [L, 2 (K, V), pages, page_size, heads, head_dim]\n"
          "(latent KV: one tensor, one head). EP pages hold every head, TP pages this rank's\n"
          "head slice (tp_slice_of_rank), so TP has tp_pages_per_ep_page times the pages.")
      .def("__repr__", [](const py_rank_memory& m) {
        std::ostringstream os;
        os << "RankMemory(device=" << m.memory.device
           << ", arena=" << m.memory.space(memory_space::arena).bytes
           << " B, kv_pool=" << m.memory.space(memory_space::kv_pool).bytes << " B)";
        return os.str();
      });

  m.def(
      "validate_rank_memory",
      [](const std::vector<const py_rank_memory*>& ranks) {
        std::vector<rank_memory> all;
        for (const py_rank_memory* r : ranks) all.push_back(r->memory);
        validate_rank_memory(all);
      },
      nb::arg("ranks"),
      "Raises moebius.Error unless the ranks' spaces are sane and no two of them overlap.");
}

}  // namespace moebius::python
