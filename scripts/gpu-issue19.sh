#!/usr/bin/env bash
# The GPU checks and measurements of the progressive switch beside the decode steps (one H200,
# virtual ranks), run on the device machine from a carry (scripts/carry-build
# test_mini_engine_gpu_runtime bench_mini_engine_switch_under_load moebius_demo):
#   tests  the GPU runtime's tests (the [overlap] cases: tiny model and Qwen3-30B-A3B layer
#          shapes, P = 2 and 4, stop-the-world and progressive beside the steps, a fault)
#   demo   moebius_demo on the GPU (2 virtual ranks)
#   bench  bench_mini_engine_switch_under_load at P = 2 and 4 (JSON lines into $OUT)
# Usage: scripts/gpu-issue19.sh [tests] [demo] [bench]   (default: all three)
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$root/.carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
OUT="${OUT:-$root/gpu-check-out}"
mkdir -p "$OUT"
what=("$@")
((${#what[@]})) || what=(tests demo bench)
status=0
for w in "${what[@]}"; do
  case $w in
    tests)
      TEST_TIMEOUT=${TEST_TIMEOUT:-480} scripts/run-carried tests test_mini_engine_gpu_runtime || status=1
      tail -n 4 "$OUT/test_mini_engine_gpu_runtime.log" ;;
    demo)
      .carry/bin/moebius_demo >"$OUT/demo_gpu.txt" 2>&1 || status=1
      tail -n 40 "$OUT/demo_gpu.txt" ;;
    bench)
      for P in ${BENCH_P:-2 4}; do
        MOEBIUS_BENCH_P=$P MOEBIUS_BENCH_SUMMARY="$OUT/switch_under_load_p$P.jsonl" \
          .carry/bin/bench_mini_engine_switch_under_load >"$OUT/switch_under_load_p$P.txt" 2>&1 || status=1
        grep -v "^  progressive" "$OUT/switch_under_load_p$P.txt"
        grep "^  progressive" "$OUT/switch_under_load_p$P.txt" | cut -c1-200 | head -80
      done ;;
  esac
done
exit $status
