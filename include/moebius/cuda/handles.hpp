#pragma once

// Owning handles for the CUDA objects the GPU transports hold: streams, events, device
// allocations, CUDA IPC mappings, instantiated graphs and peer access, plus a guard that sets
// the current device for a scope and restores the caller's. Move-only; destructors never
// throw and release on the object's own device, so no transport has a manual cleanup path
// (a constructor that throws half-way releases what it made).
//
//   device_guard g(rank.device);                       // current device until scope end
//   cuda_stream s = cuda_stream::create(rank.device);  // non-blocking stream
//   device_buffer b = device_buffer::allocate(rank.device, 4096);
//   launch(..., s.get());

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "moebius/cuda/check.hpp"

namespace moebius {

// Sets the current device for a scope (or only saves it) and restores the saved one on exit.
class device_guard {
 public:
  device_guard() { MOEBIUS_CUDA_CHECK(cudaGetDevice(&saved_)); }
  explicit device_guard(int device) : device_guard() { set(device); }
  ~device_guard() { (void)cudaSetDevice(saved_); }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

  void set(int device) { MOEBIUS_CUDA_CHECK(cudaSetDevice(device)); }

 private:
  int saved_ = 0;
};

namespace detail {

// Runs `release` with `device` current and the caller's device restored after; never throws
// (destructors: a failed release leaks, it cannot be reported).
template <class F>
void release_on(int device, F&& release) noexcept {
  int saved = -1;
  const bool have = cudaGetDevice(&saved) == cudaSuccess;
  if (device >= 0) (void)cudaSetDevice(device);
  release();
  if (have) (void)cudaSetDevice(saved);
}

// Move-only owner of one handle `T` (nullptr = none) released by `Release` on `device`.
template <class T, class Derived>
class unique_cuda_handle {
 public:
  unique_cuda_handle() = default;
  unique_cuda_handle(T handle, int device) noexcept : handle_(handle), device_(device) {}
  ~unique_cuda_handle() { reset(); }
  unique_cuda_handle(unique_cuda_handle&& o) noexcept
      : handle_(std::exchange(o.handle_, nullptr)), device_(o.device_) {}
  unique_cuda_handle& operator=(unique_cuda_handle&& o) noexcept {
    if (this != &o) {
      reset();
      handle_ = std::exchange(o.handle_, nullptr);
      device_ = o.device_;
    }
    return *this;
  }
  unique_cuda_handle(const unique_cuda_handle&) = delete;
  unique_cuda_handle& operator=(const unique_cuda_handle&) = delete;

  T get() const noexcept { return handle_; }
  int device() const noexcept { return device_; }
  explicit operator bool() const noexcept { return handle_ != nullptr; }
  void reset() noexcept {
    if (handle_ != nullptr) {
      T h = std::exchange(handle_, nullptr);
      release_on(device_, [h] { Derived::release(h); });
    }
  }

 private:
  T handle_ = nullptr;
  int device_ = -1;
};

}  // namespace detail

// A non-blocking stream on a device (it does not synchronize with the legacy stream).
class cuda_stream : public detail::unique_cuda_handle<cudaStream_t, cuda_stream> {
 public:
  using unique_cuda_handle::unique_cuda_handle;
  static cuda_stream create(int device) {
    device_guard g(device);
    cudaStream_t s = nullptr;
    MOEBIUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return {s, device};
  }
  static void release(cudaStream_t s) noexcept {
    (void)cudaStreamSynchronize(s);  // work still queued must not outlive its stream's owner
    (void)cudaStreamDestroy(s);
  }
};

// An event on a device; by default without timing (cheapest to record and wait on).
class cuda_event : public detail::unique_cuda_handle<cudaEvent_t, cuda_event> {
 public:
  using unique_cuda_handle::unique_cuda_handle;
  static cuda_event create(int device, unsigned flags = cudaEventDisableTiming) {
    device_guard g(device);
    cudaEvent_t e = nullptr;
    MOEBIUS_CUDA_CHECK(cudaEventCreateWithFlags(&e, flags));
    return {e, device};
  }
  static void release(cudaEvent_t e) noexcept { (void)cudaEventDestroy(e); }
};

// A cudaMalloc allocation.
class device_buffer : public detail::unique_cuda_handle<void*, device_buffer> {
 public:
  using unique_cuda_handle::unique_cuda_handle;
  static device_buffer allocate(int device, int64_t bytes) {
    MOEBIUS_CHECK(bytes >= 0, errc::invalid_argument, "device_buffer of ", bytes, " bytes");
    device_guard g(device);
    void* p = nullptr;
    if (bytes > 0) MOEBIUS_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(bytes)));
    return {p, device};
  }
  static void release(void* p) noexcept { (void)cudaFree(p); }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(get());
  }
};

// A peer's allocation opened through CUDA IPC (cudaIpcOpenMemHandle) on a device.
class ipc_mapping : public detail::unique_cuda_handle<void*, ipc_mapping> {
 public:
  using unique_cuda_handle::unique_cuda_handle;
  static void release(void* p) noexcept { (void)cudaIpcCloseMemHandle(p); }
};

// Page-locked host memory (cudaHostAlloc): what the device writes there with cudaMemcpyAsync
// is readable by the host once the copy's stream has passed it, without another copy.
class pinned_host_buffer : public detail::unique_cuda_handle<void*, pinned_host_buffer> {
 public:
  using unique_cuda_handle::unique_cuda_handle;
  static pinned_host_buffer allocate(int64_t bytes) {
    MOEBIUS_CHECK(bytes > 0, errc::invalid_argument, "pinned_host_buffer of ", bytes, " bytes");
    void* p = nullptr;
    MOEBIUS_CUDA_CHECK(cudaHostAlloc(&p, static_cast<size_t>(bytes), cudaHostAllocPortable));
    return {p, -1};
  }
  static void release(void* p) noexcept { (void)cudaFreeHost(p); }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(get());
  }
};

// An instantiated CUDA graph (the graph it came from is not kept).
class cuda_graph_exec : public detail::unique_cuda_handle<cudaGraphExec_t, cuda_graph_exec> {
 public:
  using unique_cuda_handle::unique_cuda_handle;
  static void release(cudaGraphExec_t g) noexcept { (void)cudaGraphExecDestroy(g); }
};

// A captured CUDA graph.
class cuda_graph : public detail::unique_cuda_handle<cudaGraph_t, cuda_graph> {
 public:
  using unique_cuda_handle::unique_cuda_handle;
  static void release(cudaGraph_t g) noexcept { (void)cudaGraphDestroy(g); }
};

// Peer access from device `from` to device `to` for the guard's lifetime. Peer access is
// state of the whole process, so guards are counted per (from, to): the first one enables it,
// the last one disables it again, unless it was already enabled before any guard (someone
// else's, then: left alone). Throws errc::cuda naming both devices when they cannot reach
// each other.
class peer_access_guard {
 public:
  peer_access_guard() = default;
  peer_access_guard(int from, int to) : from_(from), to_(to) {
    int can = 0;
    MOEBIUS_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to));
    MOEBIUS_CHECK(can != 0, errc::cuda, "device ", from, " cannot access device ", to,
                  " (no peer access: ranks on these devices cannot write each other's memory)");
    std::lock_guard lock(registry_mutex());
    entry& e = registry()[{from, to}];
    if (e.guards == 0) {
      device_guard g(from);
      const cudaError_t st = cudaDeviceEnablePeerAccess(to, 0);
      if (st == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // not sticky: clear it
        e.ours = false;
      } else {
        MOEBIUS_CUDA_CHECK(st);
        e.ours = true;
      }
    }
    ++e.guards;
  }
  ~peer_access_guard() { reset(); }
  peer_access_guard(peer_access_guard&& o) noexcept
      : from_(std::exchange(o.from_, -1)), to_(std::exchange(o.to_, -1)) {}
  peer_access_guard& operator=(peer_access_guard&& o) noexcept {
    if (this != &o) {
      reset();
      from_ = std::exchange(o.from_, -1);
      to_ = std::exchange(o.to_, -1);
    }
    return *this;
  }
  peer_access_guard(const peer_access_guard&) = delete;
  peer_access_guard& operator=(const peer_access_guard&) = delete;

  void reset() noexcept {
    if (from_ < 0) return;
    std::lock_guard lock(registry_mutex());
    entry& e = registry()[{from_, to_}];
    if (--e.guards == 0 && e.ours) {
      const int to = to_;
      detail::release_on(from_, [to] {
        (void)cudaDeviceDisablePeerAccess(to);
        (void)cudaGetLastError();
      });
    }
    from_ = to_ = -1;
  }

 private:
  struct entry {
    int guards = 0;
    bool ours = false;
  };
  static std::mutex& registry_mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<std::pair<int, int>, entry>& registry() {
    static std::map<std::pair<int, int>, entry> r;
    return r;
  }
  int from_ = -1;
  int to_ = -1;
};

}  // namespace moebius
