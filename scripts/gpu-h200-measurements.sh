#!/usr/bin/env bash
# The measurements that need an H200, on the GPU machine, in parts that each fit one call:
#   fidelity  the simulated runtime's fidelity against the GPU runtime at P = 1 and 2
#             (mini_engine_fidelity, 8 layers, seed 1), then the GPU runtime's layout and dcp
#             tests and the switch-layouts test (the tokens equal across layouts and a switching
#             run's equal a static run's): ~250 s
#   curves    every static layout's full-size (94-layer) step curves over the operating region
#             (scripts/gpu-region-curves.sh, no stage profile): ~380 s
#   tests     every carried test (scripts/run-carried tests: each .carry/bin/test_*), the GPU
#             regression; carry every test labelled gpu first (scripts/carry-build, no targets)
# Built here with
#   scripts/carry-build bench_mini_engine_rank_share mini_engine_fidelity \
#       test_mini_engine_gpu_runtime test_switch_layouts_gpu
# and on the GPU machine (kind nvidia-h200, carry .carry):
#   OUT=<dir> scripts/gpu-h200-measurements.sh fidelity|curves|tests|all
# Writes under $OUT: card.txt; fidelity/ (layers8_seed1_p{1,2}/ with fidelity.json, the
# measured run's steps and the log; tests/ with each test's log); region/ (region_<layout>.jsonl,
# curves.txt); tests/ (each carried test's log); each part packed into <part>.tgz as well.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$root/.carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
OUT="${OUT:-$root/gpu-h200-out}"
part="${1:-all}"
case "$part" in fidelity | curves | tests | all) ;;
  *) echo "usage: $0 fidelity|curves|tests|all" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
status=0
if [ "$part" = fidelity ] || [ "$part" = all ]; then
  for p in 1 2; do
    d="$OUT/fidelity/layers8_seed1_p$p"
    mkdir -p "$d"
    MOEBIUS_FIDELITY_LAYERS=8 MOEBIUS_FIDELITY_SEED=1 MOEBIUS_FIDELITY_P=$p OUT="$d" \
      timeout 150 .carry/bin/mini_engine_fidelity >"$d/log.txt" 2>&1 || status=1
    rm -f "$d"/fidelity_sim*_steps.csv  # the simulated runs' steps: reproducible here
    echo "fidelity P=$p done ($SECONDS s)"
  done
  mkdir -p "$OUT/fidelity/tests"
  for t in "test_mini_engine_gpu_runtime [dcp]" "test_mini_engine_gpu_runtime [layouts]" \
           "test_switch_layouts_gpu"; do
    set -- $t
    log="$OUT/fidelity/tests/$1${2:+_${2//[^a-z]/}}.txt"
    timeout 120 ".carry/bin/$1" ${2:+"$2"} >"$log" 2>&1 || status=1
    echo "$t: $(tail -n 3 "$log" | tr '\n' ' ') ($SECONDS s)"
  done
  tar czf "$OUT/fidelity.tgz" -C "$OUT" card.txt fidelity
fi
if [ "$part" = curves ] || [ "$part" = all ]; then
  mkdir -p "$OUT/region"
  PROFILE=0 CURVE_TIMEOUT="${CURVE_TIMEOUT:-75}" OUT="$OUT/region" \
    timeout 390 scripts/gpu-region-curves.sh >"$OUT/region/run.log" 2>&1 || status=1
  grep -h "== curves\|exit" "$OUT/region/curves.txt"
  tar czf "$OUT/curves.tgz" -C "$OUT" card.txt region
fi
if [ "$part" = tests ] || [ "$part" = all ]; then
  OUT="$OUT/tests" TEST_TIMEOUT="${TEST_TIMEOUT:-200}" scripts/run-carried tests || status=1
  tar czf "$OUT/tests.tgz" -C "$OUT" card.txt tests
fi
echo "total $SECONDS s"
exit $status
