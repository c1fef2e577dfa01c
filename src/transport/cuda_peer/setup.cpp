// cuda_peer_transport: configuration checks, single_process(), each local rank's streams,
// events and barrier memory, and the public accessors.

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "moebius/cuda/check.hpp"
#include "moebius/error.hpp"
#include "impl.hpp"

namespace moebius {
namespace cuda_peer {

int hardware_queues() {
  const char* v = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const int n = v != nullptr ? std::atoi(v) : 0;
  return n > 0 ? n : 8;  // the CUDA default
}

}  // namespace cuda_peer

using cuda_peer::rank_state;

void request_hardware_queues_for_virtual_ranks() {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
}

const char* to_string(engine_policy policy) {
  switch (policy) {
    case engine_policy::automatic: return "automatic";
    case engine_policy::copy_engine: return "copy_engine";
    case engine_policy::sm_kernel: return "sm_kernel";
  }
  return "unknown";
}

cuda_peer_transport::impl::~impl() {
  // A plan still outstanding must finish before its descriptors, graphs and streams go.
  if (outstanding) drain();
  cache.clear();
  current.reset();
}

void cuda_peer_transport::impl::check_config() const {
  const cuda_peer_config& c = config;
  MOEBIUS_CHECK(c.sm_kernel_threads >= 32 && c.sm_kernel_threads <= peer_copy_max_threads &&
                    c.sm_kernel_threads % 32 == 0,
                errc::invalid_argument, "sm_kernel_threads must be a multiple of 32 in [32, ",
                peer_copy_max_threads, "] (sm_kernel_threads=", c.sm_kernel_threads, ")");
  MOEBIUS_CHECK(c.sm_kernel_blocks >= 0, errc::invalid_argument,
                "sm_kernel_blocks must be >= 0 (sm_kernel_blocks=", c.sm_kernel_blocks, ")");
  MOEBIUS_CHECK(c.sm_chunk_bytes >= 16 && c.sm_chunk_bytes <= (int64_t{1} << 30) &&
                    (c.sm_chunk_bytes & (c.sm_chunk_bytes - 1)) == 0,
                errc::invalid_argument,
                "sm_chunk_bytes must be a power of two in [16, 2^30] (sm_chunk_bytes=",
                c.sm_chunk_bytes, ")");
  MOEBIUS_CHECK(c.barrier_timeout_ns > 0, errc::invalid_argument,
                "barrier_timeout_ns must be > 0 (barrier_timeout_ns=", c.barrier_timeout_ns, ")");
  MOEBIUS_CHECK(c.copy_engine_min_op_bytes >= 0 && c.copy_engine_max_ops_per_phase >= 0,
                errc::invalid_argument,
                "copy_engine_min_op_bytes and copy_engine_max_ops_per_phase must be >= 0 (",
                c.copy_engine_min_op_bytes, ", ", c.copy_engine_max_ops_per_phase, ")");
  MOEBIUS_CHECK(c.max_cached_plans >= 0, errc::invalid_argument,
                "max_cached_plans must be >= 0 (max_cached_plans=", c.max_cached_plans, ")");
}

void cuda_peer_transport::impl::init_local(rank_state& r) {
  r.local = true;
  const int device = r.device();
  device_guard guard(device);
  MOEBIUS_CUDA_CHECK(cudaDeviceGetAttribute(&r.sm_count, cudaDevAttrMultiProcessorCount, device));
  r.stream = cuda_stream::create(device);
  if (r.alone_on_device) {
    r.side_stream = cuda_stream::create(device);
    r.fork_event = cuda_event::create(device);
    r.join_event = cuda_event::create(device);
  }
  r.done_event = cuda_event::create(device);
  const size_t bytes = cuda_peer::barrier_alloc_bytes(num_ranks);
  r.barrier_alloc = device_buffer::allocate(device, static_cast<int64_t>(bytes));
  // On the rank's own (non-blocking) stream and waited for: a legacy-stream memset could
  // still be pending when a peer's first arrival lands.
  MOEBIUS_CUDA_CHECK(cudaMemsetAsync(r.barrier_alloc.get(), 0, bytes, r.stream.get()));
  MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(r.stream.get()));
  r.flags = r.barrier_alloc.as<uint64_t>();
  r.status = reinterpret_cast<barrier_status*>(r.barrier_alloc.as<std::byte>() +
                                               cuda_peer::status_offset(num_ranks));
}

void cuda_peer_transport::impl::upload_peer_flags() {
  std::vector<uint64_t*> h(static_cast<size_t>(num_ranks));
  for (int j = 0; j < num_ranks; ++j) h[static_cast<size_t>(j)] = ranks[static_cast<size_t>(j)].flags;
  const auto bytes = static_cast<int64_t>(h.size() * sizeof(uint64_t*));
  for (rank_state& r : ranks) {
    if (!r.local) continue;
    device_guard guard(r.device());
    r.d_peer_flags = device_buffer::allocate(r.device(), bytes);
    MOEBIUS_CUDA_CHECK(cudaMemcpyAsync(r.d_peer_flags.get(), h.data(), static_cast<size_t>(bytes),
                                       cudaMemcpyHostToDevice, r.stream.get()));
    MOEBIUS_CUDA_CHECK(cudaStreamSynchronize(r.stream.get()));
  }
}

void cuda_peer_transport::impl::finish_setup() {
  std::vector<rank_memory> all;
  for (const rank_state& r : ranks) all.push_back(r.memory);
  for (int s = 0; s < num_memory_spaces; ++s) {
    min_bytes[s] = common_space_bytes(all, static_cast<memory_space>(s));
  }
  local.clear();
  for (int r = 0; r < num_ranks; ++r) {
    if (ranks[static_cast<size_t>(r)].local) local.push_back(r);
  }
  host_status = pinned_host_buffer::allocate(
      static_cast<int64_t>(local.size() * sizeof(barrier_status)));
}

void cuda_peer_transport::impl::validate(const plan& p) const {
  MOEBIUS_CHECK(p.num_ranks == num_ranks, errc::invalid_argument, "the plan is for ",
                p.num_ranks, " ranks but the transport has ", num_ranks);
  moebius::validate(p, min_bytes);
}

// ---------------------------------------------------------------------------------------------

cuda_peer_transport::cuda_peer_transport(std::unique_ptr<impl> state) : impl_(std::move(state)) {}
cuda_peer_transport::cuda_peer_transport(cuda_peer_transport&&) noexcept = default;
cuda_peer_transport& cuda_peer_transport::operator=(cuda_peer_transport&&) noexcept = default;
cuda_peer_transport::~cuda_peer_transport() = default;

cuda_peer_transport cuda_peer_transport::single_process(std::vector<rank_memory> ranks,
                                                        const cuda_peer_config& config) {
  validate_rank_memory(ranks, memory_kind_rule::require_device);
  MOEBIUS_CHECK(ranks.size() <= 1024, errc::invalid_argument,
                "cuda_peer_transport supports at most 1024 ranks (ranks=", ranks.size(), ")");
  auto st = std::make_unique<impl>();
  st->config = config;
  st->check_config();
  st->num_ranks = static_cast<int>(ranks.size());
  int num_devices = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&num_devices));
  std::vector<int> per_device(static_cast<size_t>(num_devices), 0);
  for (size_t r = 0; r < ranks.size(); ++r) {
    const int d = ranks[r].device;
    MOEBIUS_CHECK(d < num_devices, errc::invalid_argument, "rank ", r, " names device ", d,
                  " but this process sees ", num_devices, " devices");
    ++per_device[static_cast<size_t>(d)];
  }

  // Peer access between every pair of distinct devices, for the transport's lifetime.
  for (int a = 0; a < num_devices; ++a) {
    for (int b = 0; b < num_devices; ++b) {
      if (a == b || per_device[static_cast<size_t>(a)] == 0 ||
          per_device[static_cast<size_t>(b)] == 0) {
        continue;
      }
      st->peer_access.emplace_back(a, b);
    }
  }

  // Virtual ranks spin in barriers waiting for each other: two ranks' streams sharing a
  // hardware queue would deadlock until the barrier timeout.
  for (size_t d = 0; d < per_device.size(); ++d) {
    MOEBIUS_CHECK(per_device[d] <= cuda_peer::hardware_queues(), errc::invalid_argument,
                  per_device[d], " virtual ranks on device ", d, " need ", per_device[d],
                  " hardware queues but CUDA_DEVICE_MAX_CONNECTIONS gives ",
                  cuda_peer::hardware_queues(),
                  ": call request_hardware_queues_for_virtual_ranks() (or set "
                  "CUDA_DEVICE_MAX_CONNECTIONS, at most 32) before the first CUDA call");
  }

  st->ranks.resize(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    rank_state& rs = st->ranks[r];
    rs.memory = ranks[r];
    rs.alone_on_device = per_device[static_cast<size_t>(rs.device())] == 1;
    st->init_local(rs);
  }
  st->upload_peer_flags();
  st->finish_setup();
  return cuda_peer_transport(std::move(st));
}

int cuda_peer_transport::num_ranks() const { return impl_->num_ranks; }
void cuda_peer_transport::validate(const plan& p) const { impl_->validate(p); }
std::vector<int> cuda_peer_transport::local_ranks() const { return impl_->local; }
int64_t cuda_peer_transport::completed_phases() const { return impl_->completed; }
void cuda_peer_transport::inject_fault(std::optional<fault_point> at) { impl_->fault = at; }
int cuda_peer_transport::process_rank() const { return impl_->process_rank; }

bool cuda_peer_transport::is_local(int rank) const {
  return rank >= 0 && rank < impl_->num_ranks && impl_->ranks[static_cast<size_t>(rank)].local;
}

int cuda_peer_transport::device_of(int rank) const {
  MOEBIUS_CHECK(is_local(rank), errc::invalid_argument, "rank ", rank,
                " is not driven by this process");
  return impl_->ranks[static_cast<size_t>(rank)].device();
}

cudaStream_t cuda_peer_transport::stream_of(int rank) const {
  MOEBIUS_CHECK(is_local(rank), errc::invalid_argument, "rank ", rank,
                " is not driven by this process");
  return impl_->ranks[static_cast<size_t>(rank)].stream.get();
}

const cuda_peer_config& cuda_peer_transport::config() const { return impl_->config; }
const cuda_execute_stats& cuda_peer_transport::last_execute_stats() const { return impl_->stats; }

}  // namespace moebius
