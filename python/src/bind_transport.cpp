// The transport interface and the host transport (transport/).

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include "common.hpp"

namespace moebius::python {

void bind_transport(nb::module_& m) {
  nb::class_<transport>(
      m, "Transport",
      "Runs a plan, phase by phase, on its P ranks: prepare / enqueue / poll / wait / execute.\n"
      "A plan either completes or fails at some phase k (completed_phases() == k); failures\n"
      "raise moebius.Error (injected_fault, timeout, cuda, nccl).")
      .def("num_ranks", &transport::num_ranks)
      .def("local_ranks", &transport::local_ranks,
           "The ranks this process drives; enqueue()'s streams are indexed like this list.")
      .def("validate", &transport::validate, nb::arg("plan"),
           "Raises moebius.Error unless `plan` fits this transport's ranks and memory.")
      .def("prepare", &transport::prepare, nb::arg("plan"), nb::call_guard<nb::gil_scoped_release>(),
           "Validates `plan` and caches what the transport derives from it.")
      .def(
          "enqueue",
          [](transport& t, const plan& p, const std::vector<uintptr_t>& streams) {
            std::vector<stream_handle> handles;
            for (uintptr_t s : streams) handles.push_back(stream_of_int(s));
            nb::gil_scoped_release release;
            t.enqueue(p, handles);
          },
          nb::arg("plan"), nb::arg("streams") = std::vector<uintptr_t>{},
          "Starts `plan` on `streams` (one cudaStream_t as int per local rank, 0 = the\n"
          "transport's own; empty = all its own) without waiting for the device.")
      .def("poll", &transport::poll, "True once the outstanding plan finished or failed.")
      .def("wait", &transport::wait, nb::call_guard<nb::gil_scoped_release>(),
           "Blocks until the outstanding plan finished; raises its failure.")
      .def("execute", &transport::execute, nb::arg("plan"),
           nb::call_guard<nb::gil_scoped_release>(), "enqueue(plan) then wait().")
      .def("completed_phases", &transport::completed_phases,
           "Phases of the last plan that completed on every rank.")
      .def(
          "inject_fault",
          [](transport& t, std::optional<int64_t> phase, int64_t op) {
            if (phase) {
              t.inject_fault(fault_point{*phase, op});
            } else {
              t.inject_fault(std::nullopt);
            }
          },
          nb::arg("phase").none(), nb::arg("op") = 0,
          "Test hook: the next plan fails with injected_fault before op `op` of phase `phase`\n"
          "(None disarms).");

  nb::class_<host_transport, transport>(
      m, "HostTransport",
      "The reference transport: P ranks in host memory (numpy arrays, torch CPU tensors, or\n"
      "(pointer, bytes, -1) tuples), copies done on the CPU inside enqueue().")
      .def(
          "__init__",
          [](nb::pointer_and_handle<host_transport> self, const std::vector<nb::handle>& ranks) {
            new (self.p) host_transport(rank_memories_of(ranks));
            // The transport points into the ranks' memory: keep it alive as long as we live.
            for (nb::handle r : ranks) keep_alive(self.h, r);
          },
          nb::arg("ranks"), "One RankMemory per rank, all host memory.");
}

}  // namespace moebius::python
