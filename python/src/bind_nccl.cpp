// The NCCL transport from Python (transport/nccl_transport.hpp): communicators made from a
// unique id (moebius.distributed carries it over the engine's torch.distributed group), the
// staging workspaces the transport needs, and the transport itself. Compiled only when the
// library has NCCL (moebius.with_nccl).

#include "common.hpp"

#if MOEBIUS_WITH_NCCL

#include <cuda_runtime_api.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "moebius/cuda/check.hpp"
#include "moebius/cuda/handles.hpp"
#include "moebius/cuda/nccl_check.hpp"
#include "moebius/transport/nccl_transport.hpp"

namespace moebius::python {
namespace {

// One NCCL communicator member, destroyed with this object (after every transport that uses
// it: transports keep their communicators alive).
class py_nccl_comm {
 public:
  py_nccl_comm(ncclComm_t c, int device) : comm_(c), device_(device) {}
  ~py_nccl_comm() {
    if (comm_) ncclCommDestroy(comm_);  // a destructor reports nothing
  }
  py_nccl_comm(const py_nccl_comm&) = delete;
  py_nccl_comm& operator=(const py_nccl_comm&) = delete;

  ncclComm_t get() const { return comm_; }
  int device() const { return device_; }
  int rank() const {
    int r = -1;
    MOEBIUS_NCCL_CHECK(ncclCommUserRank(comm_, &r));
    return r;
  }
  int size() const {
    int n = 0;
    MOEBIUS_NCCL_CHECK(ncclCommCount(comm_, &n));
    return n;
  }

 private:
  ncclComm_t comm_ = nullptr;
  int device_ = 0;
};

// Device staging buffers, one per local rank, freed with the transport that uses them.
struct workspaces {
  std::vector<void*> buffers;
  std::vector<int> devices;
  ~workspaces() {
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (!buffers[i]) continue;
      detail::release_on(devices[i], [&] { cudaFree(buffers[i]); });
    }
  }
};

// The transport and what it points at: its workspaces (owned) and, through keep_alive, the
// communicators and rank memory (Python objects).
class py_nccl_transport final : public transport {
 public:
  py_nccl_transport(std::vector<rank_memory> memory, std::vector<const py_nccl_comm*> comms,
                    int64_t workspace_bytes, const nccl_config& config) {
    MOEBIUS_CHECK(memory.size() == comms.size() && !memory.empty(), errc::invalid_argument,
                  "NcclTransport: one communicator per RankMemory (got ", memory.size(),
                  " ranks and ", comms.size(), " communicators)");
    MOEBIUS_CHECK(workspace_bytes >= 0, errc::invalid_argument,
                  "NcclTransport: workspace_bytes must be >= 0, got ", workspace_bytes);
    std::vector<nccl_rank_comm> rc;
    for (size_t i = 0; i < comms.size(); ++i) {
      void* buffer = nullptr;
      if (workspace_bytes > 0) {
        const device_guard on(comms[i]->device());  // the caller's device comes back
        MOEBIUS_CUDA_CHECK(cudaMalloc(&buffer, static_cast<size_t>(workspace_bytes)));
      }
      ws_.buffers.push_back(buffer);
      ws_.devices.push_back(comms[i]->device());
      rc.push_back(nccl_rank_comm{comms[i]->get(), buffer, workspace_bytes});
    }
    inner_.emplace(std::move(memory), std::move(rc), config);
  }

  int num_ranks() const override { return inner_->num_ranks(); }
  void validate(const plan& p) const override { inner_->validate(p); }
  std::vector<int> local_ranks() const override { return inner_->local_ranks(); }
  void prepare(const plan& p) override { inner_->prepare(p); }
  void enqueue(const plan& p, std::span<const stream_handle> streams) override {
    inner_->enqueue(p, streams);
  }
  bool poll() override { return inner_->poll(); }
  void wait() override { inner_->wait(); }
  int64_t completed_phases() const override { return inner_->completed_phases(); }
  void inject_fault(std::optional<fault_point> at) override { inner_->inject_fault(at); }
  void mark_phases(std::span<const int64_t> after) override { inner_->mark_phases(after); }
  event_handle phase_event(size_t mark, size_t local_index) const override {
    return inner_->phase_event(mark, local_index);
  }
  void wait_before_phases(std::span<const phase_wait> waits) override {
    inner_->wait_before_phases(waits);
  }

  nccl_transport& inner() { return *inner_; }

 private:
  workspaces ws_;  // declared first: destroyed after the transport that uses it
  std::optional<nccl_transport> inner_;
};

}  // namespace

void bind_nccl(nb::module_& m) {
  m.def(
      "nccl_unique_id",
      [] {
        ncclUniqueId id;
        MOEBIUS_NCCL_CHECK(ncclGetUniqueId(&id));
        return nb::bytes(id.internal, sizeof(id.internal));
      },
      "A new NCCL unique id (bytes): made by one rank, handed to every rank (e.g.\n"
      "torch.distributed.broadcast_object_list; moebius.distributed does it).");
  m.attr("nccl_unique_id_bytes") = int(sizeof(ncclUniqueId));

  nb::class_<py_nccl_comm>(m, "NcclCommunicator",
                           "One member of an NCCL communicator of num_ranks ranks, on `device`;\n"
                           "destroyed with the object.")
      .def(
          "__init__",
          [](py_nccl_comm* self, nb::bytes unique_id, int rank, int num_ranks, int device) {
            MOEBIUS_CHECK(unique_id.size() == sizeof(ncclUniqueId), errc::invalid_argument,
                          "NcclCommunicator: the unique id has ", unique_id.size(),
                          " bytes, NCCL's has ", sizeof(ncclUniqueId));
            MOEBIUS_CHECK(num_ranks > 0 && rank >= 0 && rank < num_ranks, errc::invalid_argument,
                          "NcclCommunicator: rank ", rank, " outside [0, ", num_ranks, ")");
            ncclUniqueId id;
            std::memcpy(id.internal, unique_id.c_str(), sizeof(id.internal));
            ncclComm_t comm = nullptr;
            {
              nb::gil_scoped_release release;  // every rank blocks here until all have joined
              const device_guard on(device);  // the caller's device comes back
              MOEBIUS_NCCL_CHECK(ncclCommInitRank(&comm, num_ranks, id, rank));
            }
            new (self) py_nccl_comm(comm, device);
          },
          nb::arg("unique_id"), nb::arg("rank"), nb::arg("num_ranks"), nb::arg("device"),
          "Collective over the num_ranks processes (or threads) that call it with the same id.")
      .def_static(
          "init_all",
          [](const std::vector<int>& devices) {
            MOEBIUS_CHECK(!devices.empty(), errc::invalid_argument,
                          "NcclCommunicator.init_all: no devices");
            std::vector<ncclComm_t> comms(devices.size());
            {
              nb::gil_scoped_release release;
              MOEBIUS_NCCL_CHECK(ncclCommInitAll(comms.data(), static_cast<int>(devices.size()),
                                                 devices.data()));
            }
            nb::list out;
            for (size_t i = 0; i < comms.size(); ++i) {
              out.append(nb::cast(new py_nccl_comm(comms[i], devices[i]),
                                  nb::rv_policy::take_ownership));
            }
            return out;
          },
          nb::arg("devices"),
          "One process drives every rank: a communicator of len(devices) ranks, rank i on\n"
          "devices[i] (distinct devices: NCCL refuses two ranks on one GPU).")
      .def_prop_ro("rank", &py_nccl_comm::rank)
      .def_prop_ro("num_ranks", &py_nccl_comm::size)
      .def_prop_ro("device", &py_nccl_comm::device);

  nb::class_<py_nccl_transport, transport>(
      m, "NcclTransport",
      "Runs plans over NCCL point-to-point calls (pack, grouped send/recv, unpack): the\n"
      "baseline transport and the path between hosts. ranks[i] and comms[i] are the same\n"
      "rank (its NCCL rank is the plan's rank index); one process may drive several ranks.")
      .def(
          "__init__",
          [](nb::pointer_and_handle<py_nccl_transport> self, const std::vector<nb::handle>& ranks,
             const std::vector<nb::handle>& comms, int64_t workspace_bytes,
             std::optional<int> max_cached_plans) {
            std::vector<rank_memory> memory;
            for (nb::handle r : ranks) {
              const py_rank_memory& mem = nb::cast<const py_rank_memory&>(r);
              MOEBIUS_CHECK(mem.on_device(), errc::invalid_argument,
                            "NcclTransport needs device memory (a CUDA tensor or a tuple with a "
                            "device ordinal), got host memory");
              memory.push_back(mem.memory);
            }
            std::vector<const py_nccl_comm*> c;
            for (nb::handle h : comms) c.push_back(&nb::cast<const py_nccl_comm&>(h));
            nccl_config config;
            if (max_cached_plans) config.max_cached_plans = *max_cached_plans;
            new (self.p) py_nccl_transport(std::move(memory), std::move(c), workspace_bytes,
                                           config);
            for (nb::handle r : ranks) keep_alive(self.h, r);
            for (nb::handle h : comms) keep_alive(self.h, h);
          },
          nb::arg("ranks"), nb::arg("comms"), nb::arg("workspace_bytes") = 0, nb::kw_only(),
          nb::arg("max_cached_plans") = nb::none(),
          "workspace_bytes: the device staging buffer allocated per local rank; it must hold\n"
          "NcclTransport.workspace_bytes(plan, rank) of every plan it runs (validate() says\n"
          "what is missing). moebius.distributed.nccl_workspace_bytes sizes it for a switcher.")
      .def_static("workspace_bytes", &nccl_transport::workspace_bytes, nb::arg("plan"),
                  nb::arg("rank"),
                  "Staging bytes rank `rank` needs to run `plan` (0 when every remote op is\n"
                  "contiguous on its side).")
      .def(
          "stream_of",
          [](py_nccl_transport& t, int rank) {
            return reinterpret_cast<uintptr_t>(t.inner().stream_of(rank));
          },
          nb::arg("rank"), "cudaStream_t of a local rank, as int (torch.cuda.ExternalStream).")
      .def("device_of", [](py_nccl_transport& t, int rank) { return t.inner().device_of(rank); },
           nb::arg("rank"))
      .def("clear_plan_cache", [](py_nccl_transport& t) { t.inner().clear_plan_cache(); });
}

}  // namespace moebius::python

#else

namespace moebius::python {
void bind_nccl(nb::module_&) {}
}  // namespace moebius::python

#endif
