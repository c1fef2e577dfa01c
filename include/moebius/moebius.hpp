#pragma once

// Everything a host-side user of Moebius needs, in one include: the Moebius::moebius component,
// which compiles and links without the CUDA Toolkit. The CUDA and NCCL components have headers
// of their own: moebius/transport/cuda_peer_transport.hpp,
// moebius/memory/device_deployment_memory.hpp, moebius/memory/device_rank_ipc.hpp
// (Moebius::cuda), moebius/transport/nccl_transport.hpp (Moebius::nccl); device-only
// declarations live in moebius/cuda/.

#include "moebius/config.hpp"
#include "moebius/error.hpp"

#include "moebius/layout/arena_geometry.hpp"
#include "moebius/layout/dtype.hpp"
#include "moebius/layout/expert_shape.hpp"
#include "moebius/layout/layout3.hpp"
#include "moebius/layout/parallel_mode.hpp"
#include "moebius/layout/weight_view.hpp"

#include "moebius/plan/copy_op.hpp"
#include "moebius/plan/memory_space.hpp"
#include "moebius/plan/plan.hpp"
#include "moebius/plan/rollback.hpp"
#include "moebius/plan/weight_plan.hpp"

#include "moebius/kv/kv_geometry.hpp"
#include "moebius/kv/dcp_change.hpp"
#include "moebius/kv/kv_migration.hpp"
#include "moebius/kv/kv_view.hpp"
#include "moebius/kv/page_table.hpp"
#include "moebius/kv/placement.hpp"

#include "moebius/transport/dry_run_transport.hpp"
#include "moebius/transport/host_transport.hpp"
#include "moebius/transport/synchronous_transport.hpp"
#include "moebius/transport/transport.hpp"

#include "moebius/switch/checksum.hpp"
#include "moebius/switch/overlap.hpp"
#include "moebius/switch/pacing.hpp"
#include "moebius/switch/progressive.hpp"
#include "moebius/switch/switch_observer.hpp"
#include "moebius/switch/switch_plan.hpp"
#include "moebius/switch/switch_report.hpp"
#include "moebius/switch/switch_stats.hpp"
#include "moebius/switch/switcher.hpp"

#include "moebius/memory/deployment_memory.hpp"
#include "moebius/memory/memory_budget.hpp"
#include "moebius/policy/calibration.hpp"
#include "moebius/policy/cost_model.hpp"
#include "moebius/policy/residency.hpp"
#include "moebius/policy/step_time_gate.hpp"
#include "moebius/policy/throughput_gate.hpp"
#include "moebius/policy/switch_policy.hpp"
