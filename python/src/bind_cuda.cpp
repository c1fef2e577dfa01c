// The CUDA peer transport: ranks on devices of this process, or one rank per process with CUDA
// IPC handles that the engine all-gathers through its own process group (no
// torch.distributed inside Moebius). Compiled only when the library has CUDA.

#include "common.hpp"

#if MOEBIUS_WITH_CUDA

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstring>
#include <future>
#include <thread>

#include "moebius/transport/cuda_peer_transport.hpp"

namespace moebius::python {

namespace {

// cuda_peer_transport takes rank_memory on a device; say so in Python's terms.
rank_memory device_memory_of(const py_rank_memory& mem) {
  MOEBIUS_CHECK(mem.on_device(), errc::invalid_argument,
                "cuda_peer_transport needs device memory (a CUDA tensor or a tuple with a "
                "device ordinal), got host memory");
  return mem.memory;
}

// The two-step form of cuda_peer_transport::multi_process: its all-gather callback runs on a
// worker thread, hands this rank's bytes to export() and waits until open() brings every
// rank's bytes (gathered by the engine, e.g. torch.distributed.all_gather_object on its own
// group). Whatever happens, the worker is joined before this object goes away.
class ipc_exchange {
 public:
  ipc_exchange(int rank, int num_ranks, const rank_memory& local,
               const cuda_peer_config& config)
      : num_ranks_(num_ranks) {
    send_future_ = send_.get_future();
    result_future_ = result_.get_future();
    auto all_gather = [this](const void* send, void* recv_all, size_t bytes_per_rank) {
      std::future<std::string> recv = recv_.get_future();
      sent_ = true;
      send_.set_value(std::string(static_cast<const char*>(send), bytes_per_rank));
      const std::string all = recv.get();  // throws when the exchange is abandoned
      MOEBIUS_CHECK(all.size() == bytes_per_rank * static_cast<size_t>(num_ranks_),
                    errc::invalid_argument, "open() needs ", num_ranks_, " x ", bytes_per_rank,
                    " bytes (every rank's export() in rank order), got ", all.size());
      std::memcpy(recv_all, all.data(), all.size());
    };
    worker_ = std::thread([this, rank, num_ranks, local, config, all_gather] {
      try {
        result_.set_value(
            cuda_peer_transport::multi_process(rank, num_ranks, local, all_gather, config));
      } catch (...) {
        if (!sent_) send_.set_exception(std::current_exception());
        result_.set_exception(std::current_exception());
      }
    });
  }

  ipc_exchange(const ipc_exchange&) = delete;
  ipc_exchange& operator=(const ipc_exchange&) = delete;

  ~ipc_exchange() {
    if (!opened_) {
      try {
        recv_.set_exception(std::make_exception_ptr(
            error(errc::invalid_argument, "moebius: the CUDA IPC exchange was abandoned",
                  __FILE__, __LINE__)));
      } catch (const std::future_error&) {  // the worker failed before it asked
      }
    }
    if (worker_.joinable()) worker_.join();
  }

  // This rank's cuda_ipc_rank_info_bytes, to be all-gathered by the caller.
  const std::string& local_info() {
    if (!have_local_) {
      local_ = send_future_.get();  // rethrows a failure before the all-gather
      have_local_ = true;
    }
    return local_;
  }

  cuda_peer_transport open(std::string all) {
    MOEBIUS_CHECK(!opened_, errc::invalid_argument, "open() was already called");
    local_info();
    opened_ = true;
    recv_.set_value(std::move(all));
    worker_.join();
    return result_future_.get();
  }

 private:
  int num_ranks_;
  std::promise<std::string> send_;
  std::future<std::string> send_future_;
  std::promise<std::string> recv_;
  std::promise<cuda_peer_transport> result_;
  std::future<cuda_peer_transport> result_future_;
  std::atomic<bool> sent_{false};
  bool have_local_ = false;
  bool opened_ = false;
  std::string local_;
  std::thread worker_;
};

// Every rank's bytes as one buffer: `all` is bytes (already concatenated) or a sequence of
// bytes, one per rank in rank order.
std::string concatenated(nb::handle all) {
  if (nb::isinstance<nb::bytes>(all)) {
    const nb::bytes b = nb::borrow<nb::bytes>(all);
    return std::string(b.c_str(), b.size());
  }
  std::string out;
  for (nb::handle item : all) {
    const nb::bytes b = nb::cast<nb::bytes>(item);
    out.append(b.c_str(), b.size());
  }
  return out;
}

nb::object wrap_transport(cuda_peer_transport t, const std::vector<nb::handle>& keep) {
  nb::object obj = nb::cast(std::move(t));
  for (nb::handle h : keep) keep_alive(obj, h);
  return obj;
}

}  // namespace

void bind_cuda(nb::module_& m) {
  nb::enum_<engine_policy>(m, "EnginePolicy", "Which engine moves an op (CUDA peer transport).")
      .value("automatic", engine_policy::automatic)
      .value("copy_engine", engine_policy::copy_engine)
      .value("sm_kernel", engine_policy::sm_kernel);

  nb::class_<cuda_peer_config>(m, "CudaPeerConfig", "Settings of the CUDA peer transport.")
      .def(nb::init<>())
      .def_rw("engine", &cuda_peer_config::engine)
      .def_rw("copy_engine_min_op_bytes", &cuda_peer_config::copy_engine_min_op_bytes)
      .def_rw("copy_engine_max_ops_per_phase", &cuda_peer_config::copy_engine_max_ops_per_phase)
      .def_rw("sm_kernel_blocks", &cuda_peer_config::sm_kernel_blocks)
      .def_rw("sm_kernel_threads", &cuda_peer_config::sm_kernel_threads)
      .def_rw("sm_chunk_bytes", &cuda_peer_config::sm_chunk_bytes)
      .def_rw("barrier_timeout_ns", &cuda_peer_config::barrier_timeout_ns)
      .def_rw("max_cached_plans", &cuda_peer_config::max_cached_plans)
      .def_rw("use_cuda_graphs", &cuda_peer_config::use_cuda_graphs);

  record<cuda_execute_stats> stats(m, "CudaExecuteStats",
                                   "What the last plan cost the host (last_execute_stats).");
  stats.field("enqueue_seconds", &cuda_execute_stats::enqueue_seconds,
              "host time enqueuing the whole plan (after prepare)")
      .field("prepare_seconds", &cuda_execute_stats::prepare_seconds,
             "host time of prepare (0 when the plan came from the cache)")
      .field("lookup_seconds", &cuda_execute_stats::lookup_seconds,
             "host time of the plan-cache lookup")
      .field("from_cache", &cuda_execute_stats::from_cache)
      .field("copy_engine_ops", &cuda_execute_stats::copy_engine_ops)
      .field("copy_engine_calls", &cuda_execute_stats::copy_engine_calls)
      .field("sm_kernel_ops", &cuda_execute_stats::sm_kernel_ops)
      .field("kernel_launches", &cuda_execute_stats::kernel_launches)
      .field("graph_launches", &cuda_execute_stats::graph_launches)
      .field("max_sm_kernel_blocks", &cuda_execute_stats::max_sm_kernel_blocks)
      .done();

  m.def("request_hardware_queues_for_virtual_ranks", &request_hardware_queues_for_virtual_ranks,
        "Sets CUDA_DEVICE_MAX_CONNECTIONS=32 (unless set) so several virtual ranks can share one\n"
        "device. Call before the process's first CUDA call (before torch touches CUDA).");
  m.attr("cuda_ipc_rank_info_bytes") = cuda_ipc_rank_info_bytes;

  nb::class_<ipc_exchange>(
      m, "CudaIpcExchange",
      "Step one of a multi-process CUDA peer transport: local_info() is this rank's bytes;\n"
      "all-gather them through the engine's own process group, then open(all) (a list of\n"
      "bytes in rank order, or their concatenation) returns the CudaPeerTransport.")
      .def("local_info",
           [](ipc_exchange& x) {
             const std::string* s = nullptr;
             {
               nb::gil_scoped_release release;
               s = &x.local_info();
             }
             return nb::bytes(s->data(), s->size());
           })
      .def(
          "open",
          [](nb::handle_t<ipc_exchange> self, nb::handle all) {
            ipc_exchange& x = nb::cast<ipc_exchange&>(self);
            std::string bytes = concatenated(all);
            std::optional<cuda_peer_transport> t;
            {
              nb::gil_scoped_release release;
              t.emplace(x.open(std::move(bytes)));
            }
            nb::object obj = nb::cast(std::move(*t));
            keep_alive(obj, self);  // the exchange keeps the RankMemory alive
            return obj;
          },
          nb::arg("all"));

  nb::class_<cuda_peer_transport, transport>(
      m, "CudaPeerTransport",
      "Moves plans between GPUs with copy engines and a fused SM kernel writing straight into\n"
      "peer memory. Ranks on devices of this process (single_process; several ranks may\n"
      "share a device), or one rank per process through CUDA IPC (export_ipc + open, or\n"
      "multi_process with an all-gather callable).")
      .def_static(
          "single_process",
          [](const std::vector<nb::handle>& ranks, std::optional<cuda_peer_config> config) {
            std::vector<rank_memory> memory;
            for (nb::handle r : ranks) {
              memory.push_back(device_memory_of(nb::cast<const py_rank_memory&>(r)));
            }
            std::optional<cuda_peer_transport> t;
            {
              nb::gil_scoped_release release;
              t.emplace(cuda_peer_transport::single_process(std::move(memory),
                                                            config.value_or(cuda_peer_config{})));
            }
            return wrap_transport(std::move(*t), ranks);
          },
          nb::arg("ranks"), nb::arg("config") = nb::none(),
          "All ranks in this process: ranks[r] is rank r's RankMemory (device memory). Plans\n"
          "run on the streams given to enqueue() (default: the transport's own, stream_of).")
      .def_static(
          "export_ipc",
          [](nb::handle memory, int rank, int num_ranks, std::optional<cuda_peer_config> config) {
            const rank_memory local = device_memory_of(nb::cast<const py_rank_memory&>(memory));
            auto* x = new ipc_exchange(rank, num_ranks, local, config.value_or(cuda_peer_config{}));
            nb::object obj = nb::cast(x, nb::rv_policy::take_ownership);
            keep_alive(obj, memory);
            return obj;
          },
          nb::arg("memory"), nb::arg("rank"), nb::arg("num_ranks"), nb::arg("config") = nb::none(),
          "Step one of the multi-process form (collective: every rank calls it): exports CUDA\n"
          "IPC handles of this rank's memory and barrier flags. Returns a CudaIpcExchange.")
      .def_static(
          "multi_process",
          [](nb::handle memory, int rank, int num_ranks, nb::object all_gather,
             std::optional<cuda_peer_config> config) {
            const rank_memory local = device_memory_of(nb::cast<const py_rank_memory&>(memory));
            auto gather = [&all_gather, num_ranks](const void* send, void* recv_all, size_t n) {
              const nb::object gathered =
                  all_gather(nb::bytes(static_cast<const char*>(send), n));
              const std::string all = concatenated(gathered);
              MOEBIUS_CHECK(all.size() == n * static_cast<size_t>(num_ranks),
                            errc::invalid_argument, "all_gather returned ", all.size(),
                            " bytes, expected ", num_ranks, " x ", n);
              std::memcpy(recv_all, all.data(), all.size());
            };
            // The callable runs on this thread, so the GIL stays held.
            cuda_peer_transport t = cuda_peer_transport::multi_process(
                rank, num_ranks, local, gather, config.value_or(cuda_peer_config{}));
            return wrap_transport(std::move(t), {memory});
          },
          nb::arg("memory"), nb::arg("rank"), nb::arg("num_ranks"), nb::arg("all_gather"),
          nb::arg("config") = nb::none(),
          "One call: all_gather(local: bytes) -> list[bytes] (rank order) or bytes.")
      .def_prop_ro("process_rank", &cuda_peer_transport::process_rank,
                   "the rank this process drives (multi-process), else -1")
      .def("device_of", &cuda_peer_transport::device_of, nb::arg("rank"))
      .def(
          "stream_of",
          [](const cuda_peer_transport& t, int rank) {
            return reinterpret_cast<uintptr_t>(t.stream_of(rank));
          },
          nb::arg("rank"), "cudaStream_t of a local rank, as int (torch.cuda.ExternalStream).")
      .def_prop_ro("last_execute_stats",
                   [](const cuda_peer_transport& t) { return t.last_execute_stats(); },
                   "a CudaExecuteStats of the last plan")
      .def("clear_plan_cache", &cuda_peer_transport::clear_plan_cache);
}

}  // namespace moebius::python

#else

namespace moebius::python {
void bind_cuda(nb::module_&) {}
}  // namespace moebius::python

#endif
