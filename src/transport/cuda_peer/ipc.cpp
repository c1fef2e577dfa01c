// cuda_peer_transport::multi_process(): this process drives one rank; ranks export CUDA IPC
// handles of their memory spaces and barrier flags, all-gather them and open the peers'.

#include <unistd.h>

#include <cstring>
#include <string>
#include <utility>

#include "../../cuda/ipc_memory.hpp"
#include "impl.hpp"
#include "moebius/cuda/check.hpp"
#include "moebius/error.hpp"

namespace moebius {
namespace {

// What one rank publishes to its peers.
struct ipc_rank_info {
  static constexpr uint32_t k_magic = 0x4d4f4542;  // "MOEB"
  static constexpr int k_handles = num_memory_spaces + 1;  // spaces, then barrier flags
  uint32_t magic = 0;
  int32_t rank = 0;
  int32_t num_ranks = 0;
  int32_t device = 0;
  int32_t pid = 0;
  uint32_t present = 0;  // bit i: handle i is valid
  int64_t offset[k_handles] = {};  // byte offset of the space inside its allocation
  int64_t bytes[k_handles] = {};
  cudaIpcMemHandle_t handle[k_handles] = {};
};
static_assert(sizeof(ipc_rank_info) <= cuda_ipc_rank_info_bytes,
              "ipc_rank_info must fit the advertised all-gather size");

}  // namespace

cuda_peer_transport cuda_peer_transport::multi_process(int rank, int num_ranks,
                                                       const rank_memory& local,
                                                       const all_gather_fn& all_gather,
                                                       const cuda_peer_config& config) {
  MOEBIUS_CHECK(num_ranks >= 1 && num_ranks <= 1024 && rank >= 0 && rank < num_ranks,
                errc::invalid_argument, "multi_process needs 0 <= rank < num_ranks <= 1024 (rank=",
                rank, ", num_ranks=", num_ranks, ")");
  MOEBIUS_CHECK(static_cast<bool>(all_gather), errc::invalid_argument,
                "multi_process needs an all-gather callback");
  validate_rank_memory(std::span(&local, 1), memory_kind_rule::require_device);
  auto st = std::make_unique<impl>();
  st->config = config;
  st->check_config();
  st->num_ranks = num_ranks;
  st->process_rank = rank;
  st->ranks.resize(static_cast<size_t>(num_ranks));
  int num_devices = 0;
  MOEBIUS_CUDA_CHECK(cudaGetDeviceCount(&num_devices));
  MOEBIUS_CHECK(local.device < num_devices, errc::invalid_argument, "rank ", rank,
                " names device ", local.device, " but this process sees ", num_devices,
                " devices");

  device_guard guard(local.device);
  cuda_peer::rank_state& me = st->ranks[static_cast<size_t>(rank)];
  me.memory = local;
  st->init_local(me);

  // Publish handles of the spaces and of the barrier flags.
  std::vector<std::byte> send(cuda_ipc_rank_info_bytes);
  std::vector<std::byte> recv(cuda_ipc_rank_info_bytes * static_cast<size_t>(num_ranks));
  {
    ipc_rank_info info;
    info.magic = ipc_rank_info::k_magic;
    info.rank = rank;
    info.num_ranks = num_ranks;
    info.device = local.device;
    info.pid = static_cast<int32_t>(getpid());
    auto publish = [&](int h, void* p, const char* what) {
      const detail::ipc_export e =
          detail::export_ipc_pointer(p, "rank " + std::to_string(rank) + "'s " + what);
      info.handle[h] = e.handle;
      info.offset[h] = e.offset;
    };
    for (int s = 0; s < num_memory_spaces; ++s) {
      if (local.spaces[s].bytes == 0) continue;
      publish(s, local.spaces[s].base, to_string(static_cast<memory_space>(s)));
      info.bytes[s] = local.spaces[s].bytes;
      info.present |= 1u << s;
    }
    publish(num_memory_spaces, me.flags, "barrier flags");
    info.bytes[num_memory_spaces] = static_cast<int64_t>(cuda_peer::barrier_alloc_bytes(num_ranks));
    info.present |= 1u << num_memory_spaces;
    std::memcpy(send.data(), &info, sizeof(info));
  }
  all_gather(send.data(), recv.data(), cuda_ipc_rank_info_bytes);

  guard.set(local.device);
  for (int j = 0; j < num_ranks; ++j) {
    ipc_rank_info info;
    std::memcpy(&info, recv.data() + static_cast<size_t>(j) * cuda_ipc_rank_info_bytes,
                sizeof(info));
    MOEBIUS_CHECK(info.magic == ipc_rank_info::k_magic && info.rank == j &&
                      info.num_ranks == num_ranks,
                  errc::invalid_argument, "all-gather slot ", j,
                  " does not hold rank ", j, "'s cuda_peer_transport info (magic=", info.magic,
                  ", rank=", info.rank, ", num_ranks=", info.num_ranks,
                  "): is the all-gather ordered by rank and are all ranks using num_ranks=",
                  num_ranks, "?");
    // Sizes come from another process: check them before anything is mapped at them.
    for (int h = 0; h < ipc_rank_info::k_handles; ++h) {
      const bool present = (info.present & (1u << h)) != 0;
      MOEBIUS_CHECK(info.bytes[h] >= 0 && info.offset[h] >= 0 && (present || info.bytes[h] == 0),
                    errc::invalid_argument, "rank ", j, " published ",
                    h < num_memory_spaces ? to_string(static_cast<memory_space>(h)) : "barrier flags",
                    " of ", info.bytes[h], " bytes at offset ", info.offset[h]);
    }
    MOEBIUS_CHECK(info.bytes[num_memory_spaces] ==
                      static_cast<int64_t>(cuda_peer::barrier_alloc_bytes(num_ranks)),
                  errc::invalid_argument, "rank ", j, " published barrier flags of ",
                  info.bytes[num_memory_spaces], " bytes, expected ",
                  cuda_peer::barrier_alloc_bytes(num_ranks));
    if (j == rank) continue;
    cuda_peer::rank_state& peer = st->ranks[static_cast<size_t>(j)];
    peer.memory.device = info.device;  // the peer's own ordinal, for messages and checks
    // Open each distinct allocation once (two spaces may share one cudaMalloc).
    void* opened[ipc_rank_info::k_handles] = {};
    for (int h = 0; h < ipc_rank_info::k_handles; ++h) {
      if ((info.present & (1u << h)) == 0) continue;
      for (int g = 0; g < h; ++g) {
        if ((info.present & (1u << g)) != 0 &&
            std::memcmp(&info.handle[g], &info.handle[h], sizeof(cudaIpcMemHandle_t)) == 0) {
          opened[h] = opened[g];
        }
      }
      if (opened[h] == nullptr) {
        const std::string what =
            "rank " + std::to_string(j) + " (pid " + std::to_string(info.pid) + ", device " +
            std::to_string(info.device) + ") for " +
            (h < num_memory_spaces ? to_string(static_cast<memory_space>(h)) : "barrier flags") +
            " on rank " + std::to_string(rank) + " (device " + std::to_string(local.device) + ")";
        opened[h] = detail::open_ipc_memory(info.handle[h], what);
        st->ipc_mappings.emplace_back(opened[h], local.device);
      }
      std::byte* p = static_cast<std::byte*>(opened[h]) + info.offset[h];
      if (h < num_memory_spaces) {
        peer.memory.spaces[h] = memory_span(p, info.bytes[h]);
      } else {
        peer.flags = reinterpret_cast<uint64_t*>(p);
      }
    }
  }
  // The same checks as single_process, over every rank's spaces as mapped here: a peer that
  // exported the same allocation as another rank (or as this one) overlaps it.
  {
    std::vector<rank_memory> all;
    for (const cuda_peer::rank_state& r : st->ranks) all.push_back(r.memory);
    validate_rank_memory(all, memory_kind_rule::require_device);
  }
  st->upload_peer_flags();
  st->finish_setup();
  return cuda_peer_transport(std::move(st));
}

}  // namespace moebius
