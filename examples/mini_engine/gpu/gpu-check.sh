#!/usr/bin/env bash
# Runs, in one call on a GPU machine, from binaries built elsewhere and carried (docs/GPU.md,
# "Building on a CPU machine"): the mini-engine GPU runtime's tests, its decode-step benchmark,
# the hybrid-step benchmark and the demo on the GPU runtime (moebius_demo --runtime gpu).
#
#   here:  scripts/carry-build test_mini_engine_gpu_kernels test_mini_engine_gpu_runtime \
#                test_mini_engine_gpu_model bench_mini_engine_step \
#                bench_mini_engine_hybrid_step moebius_demo
#          (copies them into .carry/bin, libbenchmark into .carry/lib; or by hand from
#          build-carry/examples/mini_engine/{gpu,demo}/)
#   there: examples/mini_engine/gpu/gpu-check.sh          (carry .carry; OUT is set there)
#
# Usage: gpu-check.sh [--bin DIR] [--tests-only | --bench-only | --demo-only]
#   --bin DIR   where the binaries are (default: .carry/bin, else the build folders)
# Environment: OUT (results; default ./gpu-check-out), MOEBIUS_BENCH_CONTEXT (1024),
#   MINI_ENGINE_SIMPLE_ATTENTION=1 (the simple attention kernel in the runtime),
#   MINI_ENGINE_ATTENTION=split|mma (CUDA-core or tensor-core attention at every bucket),
#   MINI_ENGINE_PROFILE=1 (eager steps, stage_<stage>_ms counters in the step benchmark),
#   MINI_ENGINE_NO_GRAPHS=1 (no CUDA graphs: every step eager),
#   MOEBIUS_BENCH_MAX_BATCH (512), MOEBIUS_BENCH_LAYERS (48), MOEBIUS_TEST_SEED,
#   MOEBIUS_BENCH_EXPERT_DTYPE=fp8 (the step benchmark with fp8 block-scaled experts).
# Writes into $OUT (8 files): tests.txt (nvidia-smi, then the three test binaries' output),
# bench_mini_engine_step.json and bench_mini_engine_hybrid_step.json (Google Benchmark JSON),
# bench.txt (both benchmarks' console tables and summaries), bench_summary.jsonl (per batch
# TP/EP ms and the crossover; per batch and cursor hybrid vs graph ms), demo.txt (the demo's
# output: stages, table), demo/steps.csv and demo/timeline.svg.
# Each piece runs under a time limit so that the whole script fits one 10-minute device call.
# Exit status: 0 when every test passed (or was skipped), both benchmarks ran and the demo
# said "demo: ok".
set -uo pipefail

root="$(cd "$(dirname "$0")/../../.." && pwd)"
cd "$root"
OUT="${OUT:-$root/gpu-check-out}"
mkdir -p "$OUT"
mode=all
bin=""
while (($#)); do
  case "$1" in
    --bin) bin="$2"; shift ;;
    --tests-only) mode=tests ;;
    --bench-only) mode=bench ;;
    --demo-only) mode=demo ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu-check.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
if [[ -z "$bin" ]]; then
  for d in .carry/bin build-carry/examples/mini_engine/gpu build-gpu/examples/mini_engine/gpu build/examples/mini_engine/gpu; do
    if [[ -x "$d/test_mini_engine_gpu_kernels" ]]; then bin="$d"; break; fi
  done
fi
[[ -n "$bin" ]] || { echo "gpu-check.sh: no binaries found (see the header of this script)" >&2; exit 2; }

# NVLink SHARP multicast can take a shared host's GPUs out of service: keep it off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH="$root/.carry/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
# NCCL from python3's nvidia-nccl wheel, last, where the system has none.
nccl_lib="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)" &&
  [[ -d "$nccl_lib" ]] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nccl_lib"
{ nvidia-smi && nvidia-smi topo -m; } > "$OUT/tests.txt" 2>&1

status=0
if [[ $mode == all || $mode == tests ]]; then
  for t in test_mini_engine_gpu_kernels test_mini_engine_gpu_runtime test_mini_engine_gpu_model; do
    [[ -x "$bin/$t" ]] || { echo "=== $t: not built" | tee -a "$OUT/tests.txt"; status=1; continue; }
    echo "=== $t" | tee -a "$OUT/tests.txt"
    start=$(date +%s)
    # Limits keep a hang from eating the device call (60 + 210 + 60 s, the benchmarks
    # 120 + 90 s, the demo 150 s: 690 s if everything ran to its limit; the runtime test runs
    # each case with fp32, bf16 and fp8 experts, and its [virtual] cases with P = 2 and 4
    # virtual ranks, so --tests-only and --bench-only as two calls are the safe split).
    case $t in *runtime) limit=210 ;; *) limit=60 ;; esac
    timeout $limit "$bin/$t" --durations yes 2>&1 | tee -a "$OUT/tests.txt"
    rc=${PIPESTATUS[0]}
    echo "=== $t: exit $rc in $(( $(date +%s) - start )) s (77 = skipped: no GPU)" | tee -a "$OUT/tests.txt"
    [[ $rc == 0 || $rc == 77 ]] || status=1
    if [[ $rc != 0 && $rc != 77 && $t != *kernels ]]; then
      # Once more without CUDA graphs: tells a capture/replay problem from a numerics one.
      echo "=== $t again with MINI_ENGINE_NO_GRAPHS=1" | tee -a "$OUT/tests.txt"
      MINI_ENGINE_NO_GRAPHS=1 timeout 40 "$bin/$t" 2>&1 | tail -40 | tee -a "$OUT/tests.txt"
      echo "=== $t without graphs: exit ${PIPESTATUS[0]}" | tee -a "$OUT/tests.txt"
    fi
  done
fi
if [[ $mode == all || $mode == bench ]]; then
  : > "$OUT/bench.txt"
  MOEBIUS_BENCH_SUMMARY="$OUT/bench_summary.jsonl" timeout 120 "$bin/bench_mini_engine_step" \
    --benchmark_out="$OUT/bench_mini_engine_step.json" --benchmark_out_format=json \
    2>&1 | tee -a "$OUT/bench.txt"
  rc=${PIPESTATUS[0]}
  echo "=== bench_mini_engine_step: exit $rc" | tee -a "$OUT/bench.txt"
  [[ $rc == 0 ]] || status=1
  hybrid_summary="$(mktemp)"
  MOEBIUS_BENCH_SUMMARY="$hybrid_summary" timeout 90 "$bin/bench_mini_engine_hybrid_step" \
    --benchmark_out="$OUT/bench_mini_engine_hybrid_step.json" --benchmark_out_format=json \
    2>&1 | tee -a "$OUT/bench.txt"
  rc=${PIPESTATUS[0]}
  cat "$hybrid_summary" >> "$OUT/bench_summary.jsonl" 2>/dev/null
  rm -f "$hybrid_summary"
  echo "=== bench_mini_engine_hybrid_step: exit $rc" | tee -a "$OUT/bench.txt"
  [[ $rc == 0 ]] || status=1
fi
if [[ $mode == all || $mode == demo ]]; then
  # The demo's four runs on the GPU runtime (P = min(GPUs, 2)), measured clock; its table goes
  # to demo.txt, its CSV and SVG to demo/.
  demo="$bin/moebius_demo"
  [[ -x "$demo" ]] || demo="$bin/../demo/moebius_demo"  # a build folder: demo/ beside gpu/
  timeout 150 "$demo" --runtime gpu --out "$OUT/demo" 2>&1 | tee "$OUT/demo.txt"
  rc=${PIPESTATUS[0]}
  echo "=== moebius_demo --runtime gpu: exit $rc" | tee -a "$OUT/demo.txt"
  [[ $rc == 0 ]] || status=1
fi
exit $status
