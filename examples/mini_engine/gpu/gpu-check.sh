#!/usr/bin/env bash
# Runs the mini-engine GPU runtime's tests and its decode-step benchmark on a GPU machine,
# from binaries built elsewhere and carried (docs/GPU.md, "Building on a CPU machine"):
#
#   here:  cmake -S . -B build-carry -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90
#          cmake --build build-carry --target test_mini_engine_gpu_kernels \
#                test_mini_engine_gpu_runtime test_mini_engine_gpu_model bench_mini_engine_step
#          mkdir -p .carry/bin .carry/lib
#          cp build-carry/examples/mini_engine/gpu/{test_mini_engine_gpu_kernels,test_mini_engine_gpu_runtime,test_mini_engine_gpu_model,bench_mini_engine_step} .carry/bin/
#          cp -L /usr/lib/x86_64-linux-gnu/libbenchmark.so.1debian .carry/lib/
#   there: examples/mini_engine/gpu/gpu-check.sh          (carry .carry; OUT is set there)
#
# Usage: gpu-check.sh [--bin DIR] [--tests-only | --bench-only]
#   --bin DIR   where the binaries are (default: .carry/bin, else the build folders)
# Environment: OUT (results; default ./gpu-check-out), MOEBIUS_BENCH_CONTEXT (1024),
#   MINI_ENGINE_SIMPLE_ATTENTION=1 (the simple attention kernel in the runtime),
#   MOEBIUS_BENCH_MAX_BATCH (512), MOEBIUS_BENCH_LAYERS (48), MOEBIUS_TEST_SEED.
# Writes into $OUT (5 files): tests.txt (the three test binaries' output), bench_mini_engine_step.json
# (Google Benchmark JSON), bench_mini_engine_step.txt (console table + crossover summary),
# bench_step_summary.jsonl (per batch TP/EP ms and the crossover), nvidia-smi.txt.
# Exit status: 0 when every test passed (or was skipped) and the benchmark ran.
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
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
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
export LD_LIBRARY_PATH="$root/.carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 && nvidia-smi topo -m >> "$OUT/nvidia-smi.txt" 2>&1

status=0
if [[ $mode != bench ]]; then
  : > "$OUT/tests.txt"
  for t in test_mini_engine_gpu_kernels test_mini_engine_gpu_runtime test_mini_engine_gpu_model; do
    [[ -x "$bin/$t" ]] || { echo "=== $t: not built" | tee -a "$OUT/tests.txt"; status=1; continue; }
    echo "=== $t" | tee -a "$OUT/tests.txt"
    start=$(date +%s)
    # Limits keep the whole script inside one 10-minute device call even if something hangs.
    case $t in *runtime) limit=150 ;; *) limit=120 ;; esac
    timeout $limit "$bin/$t" --durations yes 2>&1 | tee -a "$OUT/tests.txt"
    rc=${PIPESTATUS[0]}
    echo "=== $t: exit $rc in $(( $(date +%s) - start )) s (77 = skipped: no GPU)" | tee -a "$OUT/tests.txt"
    [[ $rc == 0 || $rc == 77 ]] || status=1
  done
fi
if [[ $mode != tests ]]; then
  MOEBIUS_BENCH_SUMMARY="$OUT/bench_step_summary.jsonl" timeout 200 "$bin/bench_mini_engine_step" \
    --benchmark_out="$OUT/bench_mini_engine_step.json" --benchmark_out_format=json \
    2>&1 | tee "$OUT/bench_mini_engine_step.txt"
  rc=${PIPESTATUS[0]}
  echo "=== bench_mini_engine_step: exit $rc"
  [[ $rc == 0 ]] || status=1
fi
exit $status
