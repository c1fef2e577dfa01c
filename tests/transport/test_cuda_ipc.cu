// cuda_peer_transport across processes over CUDA IPC. The test re-executes itself
// (/proc/self/exe, hidden test case "[ipc_child]") as P child processes, one rank each, on
// device rank % num_devices; the children all-gather their IPC handles through files in a
// fresh directory (the library's all-gather is a caller callback). Each child checks its own
// rank's bytes against the static-load reference; the parent collects the exit codes. Children
// are started with posix_spawn (exec right away), never by forking a process that holds CUDA.

#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "support/cuda_test_util.hpp"
#include "moebius/error.hpp"
#include "moebius/plan/weight_plan.hpp"
#include "moebius/transport/cuda_peer_transport.hpp"
#include "support/catch.hpp"
#include "support/reference.hpp"

extern char** environ;

namespace mt = moebius::testing;
using namespace moebius;

namespace {

const char* env_or_null(const char* name) { return std::getenv(name); }

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// All-gather through files: rank r writes <dir>/ag<call>_<r>.bin (atomically, by rename) and
// waits for every other rank's file of the same call.
class file_all_gather {
 public:
  file_all_gather(std::string dir, int rank, int num_ranks)
      : dir_(std::move(dir)), rank_(rank), num_ranks_(num_ranks) {}

  void operator()(const void* send, void* recv_all, size_t bytes) {
    const int call = call_++;
    auto name = [&](int r) {
      return dir_ + "/ag" + std::to_string(call) + "_" + std::to_string(r) + ".bin";
    };
    {
      const std::string tmp = name(rank_) + ".tmp";
      std::ofstream out(tmp, std::ios::binary);
      out.write(static_cast<const char*>(send), static_cast<std::streamsize>(bytes));
      out.close();
      MOEBIUS_CHECK(out.good() && std::rename(tmp.c_str(), name(rank_).c_str()) == 0,
                    errc::internal, "cannot publish ", name(rank_));
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (int r = 0; r < num_ranks_; ++r) {
      while (!file_exists(name(r))) {
        MOEBIUS_CHECK(std::chrono::steady_clock::now() < deadline, errc::timeout, "rank ", rank_,
                      " waited 60 s for ", name(r));
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      std::ifstream in(name(r), std::ios::binary);
      in.read(static_cast<char*>(recv_all) + static_cast<size_t>(r) * bytes,
              static_cast<std::streamsize>(bytes));
      MOEBIUS_CHECK(in.gcount() == static_cast<std::streamsize>(bytes), errc::internal,
                    "short read of ", name(r));
    }
  }

  void barrier() {
    char byte = 0;
    std::vector<char> all(static_cast<size_t>(num_ranks_));
    (*this)(&byte, all.data(), 1);
  }

 private:
  std::string dir_;
  int rank_;
  int num_ranks_;
  int call_ = 0;
};

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  MOEBIUS_CHECK(n > 0, errc::internal, "readlink(/proc/self/exe) failed");
  buf[n] = '\0';
  return buf;
}

// Starts num_ranks children of this executable running the hidden child test in `mode`, waits
// (at most 180 s, then kills them) and returns their exit codes (-1: killed or signalled).
std::vector<int> run_children(int num_ranks, const std::string& mode, uint64_t seed) {
  char dir_template[] = "/tmp/moebius_ipc_XXXXXX";
  MOEBIUS_CHECK(::mkdtemp(dir_template) != nullptr, errc::internal, "mkdtemp failed");
  const std::string dir = dir_template;
  const std::string exe = self_exe();
  std::vector<pid_t> pids;
  for (int r = 0; r < num_ranks; ++r) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::strncmp(*e, "MOEBIUS_", 8) != 0) env_strings.emplace_back(*e);
    }
    env_strings.push_back("MOEBIUS_IPC_RANK=" + std::to_string(r));
    env_strings.push_back("MOEBIUS_IPC_RANKS=" + std::to_string(num_ranks));
    env_strings.push_back("MOEBIUS_IPC_DIR=" + dir);
    env_strings.push_back("MOEBIUS_IPC_MODE=" + mode);
    env_strings.push_back("MOEBIUS_TEST_SEED=" + std::to_string(seed));
    std::vector<char*> envp;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string arg0 = exe;
    std::string arg1 = "[ipc_child]";
    char* argv[] = {arg0.data(), arg1.data(), nullptr};
    pid_t pid = 0;
    const int rc = ::posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data());
    MOEBIUS_CHECK(rc == 0, errc::internal, "posix_spawn failed: ", std::strerror(rc));
    pids.push_back(pid);
  }
  std::vector<int> codes(pids.size(), -1);
  std::vector<bool> done(pids.size(), false);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(180);
  size_t remaining = pids.size();
  while (remaining > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      const pid_t got = ::waitpid(pids[i], &status, WNOHANG);
      if (got == pids[i]) {
        done[i] = true;
        --remaining;
        codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      }
    }
    if (remaining > 0 && std::chrono::steady_clock::now() > deadline) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (!done[i]) {
          ::kill(pids[i], SIGKILL);
          int status = 0;
          ::waitpid(pids[i], &status, 0);
          done[i] = true;
        }
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return codes;
}

}  // namespace

TEST_CASE("weight switches across processes over CUDA IPC match the static load",
          "[cuda_peer][ipc]") {
  const uint64_t seed = mt::test_seed();
  for (int P : {2, 3, 4}) {
    const std::vector<int> codes = run_children(P, "switch", seed + static_cast<uint64_t>(P));
    for (int r = 0; r < P; ++r) {
      CAPTURE(seed, P, r);
      CHECK(codes[static_cast<size_t>(r)] == 0);
    }
  }
}

TEST_CASE("a process that never arrives is a timeout on its peers", "[cuda_peer][ipc][timeout]") {
  const uint64_t seed = mt::test_seed();
  const int P = 3;
  const std::vector<int> codes = run_children(P, "timeout", seed);
  for (int r = 0; r < P; ++r) {
    CAPTURE(seed, P, r);
    CHECK(codes[static_cast<size_t>(r)] == 0);
  }
}

TEST_CASE("ipc child", "[.][ipc_child]") {
  const char* rank_s = env_or_null("MOEBIUS_IPC_RANK");
  const char* ranks_s = env_or_null("MOEBIUS_IPC_RANKS");
  const char* dir = env_or_null("MOEBIUS_IPC_DIR");
  const char* mode_s = env_or_null("MOEBIUS_IPC_MODE");
  if (rank_s == nullptr || ranks_s == nullptr || dir == nullptr || mode_s == nullptr) {
    SUCCEED("not started as an IPC child");
    return;
  }
  const int rank = std::atoi(rank_s);
  const int P = std::atoi(ranks_s);
  const std::string mode = mode_s;
  const int device = rank % mt::device_count();
  MOEBIUS_CUDA_CHECK(cudaSetDevice(device));
  file_all_gather gather(dir, rank, P);

  // Every child derives the same shape and weights from the shared seed.
  const uint64_t seed = mt::test_seed();
  std::mt19937_64 rng(seed);
  const expert_shape shape = mt::random_shape(rng, P, mt::coin(rng));
  const arena_geometry g = mt::random_geometry(rng, shape, P);
  const mt::logical_weights w = mt::random_weights(shape, rng);
  const int64_t L = shape.num_layers;
  CAPTURE(seed, rank, P, mode, shape);

  mt::rank_images images;
  mt::load_reference(w, g, arena_cursor{0}, images);
  // The arena sits at an offset inside a larger allocation, and the KV pool shares that
  // allocation: IPC must export whole allocations and carry the offsets.
  const size_t arena_bytes = static_cast<size_t>(g.total_bytes());
  mt::device_buffer alloc(device, 4096 + arena_bytes + 8192);
  std::byte* arena = alloc.data() + 4096;
  MOEBIUS_CUDA_CHECK(cudaMemcpy(arena, images[static_cast<size_t>(rank)].data(), arena_bytes,
                                cudaMemcpyHostToDevice));
  MOEBIUS_CUDA_CHECK(cudaDeviceSynchronize());  // in place before any peer may read it
  const rank_memory local = rank_memory::on_device(
      device, arena, static_cast<int64_t>(arena_bytes), arena + arena_bytes, 8192);

  cuda_peer_config config;
  config.engine = rank % 2 == 0 ? engine_policy::sm_kernel : engine_policy::copy_engine;
  if (mode == "timeout") {
    config.barrier_timeout_ns = 200'000'000;
    config.debug_absent_rank = P - 1;
  }
  // The all-gather inside multi_process is also the point after which every rank's initial
  // image is in place.
  cuda_peer_transport t = cuda_peer_transport::multi_process(
      rank, P, local, [&](const void* s, void* r, size_t n) { gather(s, r, n); }, config);
  REQUIRE(t.process_rank() == rank);
  REQUIRE(t.is_local(rank));
  REQUIRE(t.num_ranks() == P);

  auto check_mine = [&](arena_cursor at) {
    mt::rank_images want;
    mt::load_reference(w, g, at, want);
    std::vector<std::byte> got(arena_bytes);
    MOEBIUS_CUDA_CHECK(cudaMemcpy(got.data(), arena, arena_bytes, cudaMemcpyDeviceToHost));
    // The free slot at `at` holds leftovers; every other byte must match.
    const int64_t free_begin = g.slot_offset(arena_geometry::free_slot(at));
    std::vector<std::byte>& mine = want[static_cast<size_t>(rank)];
    std::copy(got.begin() + free_begin, got.begin() + free_begin + g.slot_bytes,
              mine.begin() + free_begin);
    return mt::first_difference(mine, got, "rank " + std::to_string(rank));
  };

  if (mode == "switch") {
    const arena_cursor mid{mt::uniform(rng, 0, L)};
    const arena_cursor path[] = {arena_cursor{0}, mid, arena_cursor{L}, arena_cursor{0}};
    for (int step = 1; step < 4; ++step) {
      CAPTURE(step, path[step].tp_layers);
      t.execute(plan_weight_switch(g, path[step - 1], path[step]));
      REQUIRE(t.completed_phases() == std::abs(path[step].tp_layers - path[step - 1].tp_layers));
      REQUIRE(check_mine(path[step]) == "");
    }
  } else {
    const plan p = plan_weight_switch(g, arena_cursor{0}, arena_cursor{L});
    if (rank == P - 1) {
      t.execute(p);  // absent: enqueues nothing
    } else {
      try {
        t.execute(p);
        FAIL("execute did not throw");
      } catch (const moebius::error& err) {
        CAPTURE(err.what());
        REQUIRE(err.code() == errc::timeout);
      }
      REQUIRE(t.completed_phases() == 0);
    }
  }
  // Nobody frees memory a peer may still read.
  gather.barrier();
}
