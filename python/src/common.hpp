#pragma once

// Shared pieces of the Python binding: the memory wrapper (memory in by DLPack or
// (pointer, bytes, device)), records (C++ structs bound as Python classes generated from their
// fields: every report), and one registration function per area. Each bind_*.cpp fills one
// area of the module.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <ostream>
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

template <class T>
concept printable = requires(std::ostream& os, const T& v) { os << v; };

// The generic parts of a record (record.cpp), over the field names of its type.
std::string record_repr(nb::handle self, const std::vector<const char*>& fields);
nb::object record_eq(nb::handle self, nb::handle other, const std::vector<const char*>& fields);
nb::dict record_as_dict(nb::handle self, const std::vector<const char*>& fields);

// A C++ struct bound as a Python record, generated from its fields: each field a property
// (read-only, or read-write with field_rw for the structs a caller fills in), `__fields__`
// their names in declaration order, `__eq__` field by field (unless done(false)), `as_dict()`
// (records inside as dicts, for a JSON log), and `__repr__` the C++ operator<< where the struct
// has one, else `Name(field=value, ...)`. Reports are records, never dicts written by hand:
//
//   record<kv_capacity_report> r(m, "KvCapacityReport", "...");
//   r.field("fits", &kv_capacity_report::fits).field("reason", &kv_capacity_report::reason);
//   r.done();
template <class T>
class record : public nb::class_<T> {
 public:
  template <class... Extra>
  record(nb::handle scope, const char* name, const Extra&... extra)
      : nb::class_<T>(scope, name, extra...) {}

  template <class D>
  record& field(const char* name, D T::*member, const char* doc = "") {
    this->def_ro(name, member, doc);
    fields_.push_back(name);
    return *this;
  }
  template <class D>
  record& field_rw(const char* name, D T::*member, const char* doc = "") {
    this->def_rw(name, member, doc);
    fields_.push_back(name);
    return *this;
  }
  // A computed field (a const member function, a converted member) from `getter(const T&)`.
  template <class Getter>
  record& prop(const char* name, Getter&& getter, const char* doc = "") {
    this->def_prop_ro(name, std::forward<Getter>(getter), doc);
    fields_.push_back(name);
    return *this;
  }
  // Adds __fields__, __repr__, as_dict and (comparable) __eq__. Call once, after the fields.
  record& done(bool comparable = true) {
    nb::list names;
    for (const char* f : fields_) names.append(nb::str(f));
    this->attr("__fields__") = nb::steal(PySequence_Tuple(names.ptr()));
    if constexpr (printable<T>) {
      this->def("__repr__", &printed<T>);
    } else {
      this->def("__repr__", [f = fields_](nb::handle_t<T> self) { return record_repr(self, f); });
    }
    this->def(
        "as_dict", [f = fields_](nb::handle_t<T> self) { return record_as_dict(self, f); },
        "The fields as a dict (records inside as dicts, lists as lists): for a JSON log.");
    if (comparable) {
      this->def("__eq__", [f = fields_](nb::handle_t<T> self, nb::handle other) {
        return record_eq(self, other, f);
      });
      this->attr("__hash__") = nb::none();
    }
    return *this;
  }

 private:
  std::vector<const char*> fields_;
};

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
