#pragma once

// What every transport offers: run a plan, phase by phase, on its P ranks. The switcher and
// the example engine hold a `transport&` and never care whether bytes move by memcpy, copy
// engines, an SM kernel or NCCL.
//
// One interface, one lifecycle, one fault semantics for all of them:
//
//   prepare(p)      optional: validate `p` and cache whatever the transport derives from it
//                   (descriptors, graphs); a later enqueue of an equal plan reuses it.
//   enqueue(p, s)   validates `p` (a bad plan throws and moves nothing), then starts every
//                   phase on the local ranks' streams `s` (or the transport's own) and returns
//                   without waiting for the device. At most one plan is outstanding.
//   poll()          true once the outstanding plan has finished (or failed); never blocks.
//   wait()          blocks until it has finished; throws its failure, if any.
//   execute(p)      enqueue(p) then wait().
//
// Failures. A plan either completes or fails at some phase k: phases before k completed on
// every rank (their bytes are where the plan says), phase k may be partly done, nothing after
// it ran. wait() throws moebius::error (errc::injected_fault, errc::timeout, errc::cuda,
// errc::nccl) and completed_phases() is k afterwards; a plan's phases leave memory in a valid
// resting state after each one, so that is what a caller needs to roll back. After a barrier
// timeout or a device error the transport cannot prove that nothing ran past phase k (a slow
// peer may still pass the barrier), so callers must not trust an undo then (the switcher
// reports `inconsistent`).
//
// A host-memory transport does its copies inside enqueue() (the CPU is its device) and keeps a
// failure for wait(); device transports only enqueue.
//
// Phase events. A caller that orders its own work after part of a plan (a decode step that
// reads layer j while later layers still move) asks for events before it enqueues:
//
//   mark_phases({k0, k1, ...})   ascending phase indices of the next plan
//   enqueue(p, s)
//   phase_event(j, i)            fires on local rank i's stream once rank i's memory holds the
//                                bytes of phases [0, k_j]; a stream that waits on it (a
//                                cudaStreamWaitEvent) runs after them
//
// The events are the transport's, valid until the next enqueue(). nullptr means nothing to wait
// for: the host transport has finished its plan inside enqueue(). After a failure an event may
// fire although its phases never ran (so that no waiter hangs): only poll()/wait() say whether
// the bytes are there.
//
// Phase waits, the other way: a caller whose own work must finish before part of a plan runs
// (a decode step still reading a slot that a later layer's copy overwrites) gives events to wait
// for before it enqueues:
//
//   wait_before_phases({{k, {e_0, e_1, ...}}, ...})   one event per local rank
//   enqueue(p, s)
//
// Phase k then writes no rank's memory before every rank's event has fired: a phase writes
// peers' memory, so the wait is every rank's, not only the writer's. Phases before k run as
// soon as they can: the plan's earlier layers overlap the caller's work.

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "moebius/error.hpp"
#include "moebius/plan/plan.hpp"

namespace moebius {

// A CUDA stream (cudaStream_t) as an opaque handle, so that host-only code needs no CUDA
// header. nullptr stands for the transport's own stream of that rank.
using stream_handle = void*;

// A CUDA event (cudaEvent_t) as an opaque handle; nullptr: nothing to wait for.
using event_handle = void*;

// Where an injected fault fires: before op `op` of phase `phase` (ops before it in that phase
// may have run, phases before it are complete on every rank).
// `code`: what the fault throws. errc::injected_fault is an exact failure (the caller may undo);
// errc::timeout and errc::cuda stand for a dead peer or a device error, after which no undo is
// trusted (the switcher ends inconsistent): host_transport throws the code given, the device
// transports always injected_fault.
struct fault_point {
  int64_t phase = 0;
  int64_t op = 0;
  errc code = errc::injected_fault;
};

class transport {
 public:
  virtual ~transport() = default;

  virtual int num_ranks() const = 0;
  // The ranks this process drives, ascending: every rank for the host transport and for
  // single-process GPU transports, one rank for a multi-process deployment. enqueue()'s
  // `streams` are indexed like this list.
  virtual std::vector<int> local_ranks() const = 0;

  // Throws (errc::invalid_argument / errc::out_of_range) unless `p` fits this transport's
  // ranks and memory. Moves nothing.
  virtual void validate(const plan& p) const = 0;

  // Validates `p` and caches what the transport derives from it, so that enqueueing an equal
  // plan later costs only launches. Optional: enqueue() prepares what it is given.
  virtual void prepare(const plan& p) { validate(p); }

  // Starts `p` (see the lifecycle above) on `streams`: empty, or one per local rank (nullptr
  // entries: the transport's own stream). Work the caller enqueued on those streams before
  // runs first; work it enqueues after runs after the plan. Throws errc::invalid_argument when
  // a plan is still outstanding (call wait() first) or `streams` has the wrong length, and the
  // validation errors of validate(); in those cases nothing was started.
  virtual void enqueue(const plan& p, std::span<const stream_handle> streams = {}) = 0;

  // True when no plan is outstanding, or the outstanding one has finished or failed (wait()
  // would not block). Never blocks, never throws a plan's failure.
  virtual bool poll() = 0;

  // Blocks until the outstanding plan (if any) has finished. Throws its failure (see above);
  // either way the plan is no longer outstanding afterwards.
  virtual void wait() = 0;

  // enqueue(p) then wait(): runs `p` to completion or throws.
  void execute(const plan& p) {
    enqueue(p);
    wait();
  }

  // Phases of the last plan that completed on every rank (all of them after a successful
  // wait(); meaningful once wait() has returned or thrown).
  virtual int64_t completed_phases() const = 0;

  // What a phase of the next plan waits for (see "Phase waits" above).
  struct phase_wait {
    int64_t phase = 0;
    std::vector<event_handle> events;  // one per local rank (nullptr: nothing to wait for)
  };
  // Waits for the next enqueued plan only: `waits` ascending by phase, one event per local rank
  // each; waits past the plan's last phase are dropped at enqueue(). Throws
  // errc::invalid_argument for negative or unsorted phases or a wrong number of events, and
  // where the transport cannot wait (the host transport: events must be nullptr).
  virtual void wait_before_phases(std::span<const phase_wait> waits) = 0;

  // Phase events for the next enqueued plan only (see "Phase events" above): `after_phases`
  // ascending, each >= 0. Marks past the plan's last phase are dropped at enqueue(). Throws
  // errc::invalid_argument for negative or unsorted marks.
  virtual void mark_phases(std::span<const int64_t> after_phases) = 0;
  // The event of mark `mark` (an index into the last mark_phases() list that the last enqueued
  // plan reached) on local rank `local_index`; nullptr when there is nothing to wait for.
  // Throws errc::out_of_range for a mark or rank that does not exist.
  virtual event_handle phase_event(size_t mark, size_t local_index) const = 0;

  // Arms a fault for the next enqueued plan only: it fails with errc::injected_fault (host:
  // at.code) before op `at.op` of phase `at.phase`, and completed_phases() is then `at.phase`. A fault the plan
  // does not reach (fewer phases or ops) is dropped. std::nullopt disarms.
  virtual void inject_fault(std::optional<fault_point> at) = 0;
};

}  // namespace moebius
