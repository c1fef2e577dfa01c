#pragma once

// Shared pieces of the Python binding: the memory wrapper (memory in by DLPack or
// (pointer, bytes, device)), conversions of reports to dicts, and one registration function
// per area. Each bind_*.cpp fills one area of the module.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "moebius/moebius.hpp"

namespace moebius::python {

namespace nb = nanobind;

// DLPack device types (dlpack.h DLDeviceType) the binding accepts.
inline constexpr int dl_cpu = 1;
inline constexpr int dl_cuda = 2;
inline constexpr int dl_cuda_host = 3;  // pinned host memory: host memory for the transports

// One rank's memory as Python hands it in: the rank_memory every transport takes, plus the
// DLPack tensors it points into (kept alive as long as this object, and every view out of it,
// lives). A (pointer, bytes, device) tuple keeps nothing alive: its owner is the caller.
struct py_rank_memory {
  rank_memory memory;
  nb::object owners[num_memory_spaces];  // the DLPack imports, or None

  bool on_device() const { return memory.device != host_memory_device; }
};

// Reads one memory space from `obj`: an object with __dlpack__ (C-contiguous, writable), or
// a (pointer, bytes, device) tuple with device -1 for host memory. Sets `device` (ordinal, or
// host_memory_device) and `owner` (the import that keeps the bytes alive, or None). Throws
// moebius::error(errc::invalid_argument) for anything else.
memory_span memory_span_of(nb::handle obj, int& device, nb::object& owner);

// The rank_memory of each RankMemory in `ranks` (raises TypeError for anything else).
std::vector<rank_memory> rank_memories_of(const std::vector<nb::handle>& ranks);

// `nurse` keeps `patient` alive (nb::keep_alive for objects a constructor received).
inline void keep_alive(nb::handle nurse, nb::handle patient) { nb::keep_alive_obj(nurse, patient); }

// A stream handle from its integer value (cudaStream_t as int; 0 = the transport's own).
inline stream_handle stream_of_int(uintptr_t s) { return reinterpret_cast<stream_handle>(s); }

// What operator<< prints: __repr__/__str__ of every bound descriptor, plan and report.
template <class T>
std::string printed(const T& value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

nb::dict to_dict(const plan_traffic& t);
nb::dict to_dict(const kv_migration_stats& s);
nb::dict to_dict(const kv_capacity_report& r);
nb::dict to_dict(const switch_report& r);
// The flat metrics of a report (switch_stats.hpp metrics_of): {"moebius_switch_total_ms": ...}.
nb::dict metrics_dict(const switch_report& r);
nb::dict to_dict(const kv_placement& p);

void bind_errors(nb::module_& m);
void bind_layout(nb::module_& m);
void bind_plan(nb::module_& m);
void bind_kv(nb::module_& m);
void bind_memory(nb::module_& m);
void bind_transport(nb::module_& m);
void bind_cuda(nb::module_& m);  // no-op without CUDA
void bind_switch(nb::module_& m);
void bind_policy(nb::module_& m);
void bind_kv_csr(nb::module_& m);  // after bind_kv and bind_switch: adds methods to their classes
void bind_observer(nb::module_& m);
void bind_nccl(nb::module_& m);  // no-op without NCCL

}  // namespace moebius::python
