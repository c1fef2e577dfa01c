#!/usr/bin/env bash
# Every static layout's decode-step curves over the operating region, full size, on the GPU
# machine (one rank of P = 8 of Qwen3-235B-A22B, bench_mini_engine_rank_share: compute
# measured, collectives priced), and the stage profile of each at batch 2,048, context 512.
# Built here with `scripts/carry-build bench_mini_engine_rank_share`; on the GPU machine:
#   OUT=<dir> scripts/gpu-region-curves.sh [layouts]   (default: tp ep tp-dcp2 tep tep-dcp2)
# PROFILE=0 skips the profiles; CURVE_TIMEOUT / PROFILE_TIMEOUT bound each layout's run (s).
# Writes region_<layout>.jsonl (the files serving/step_curves reads, one per layout),
# curves.txt, profile.jsonl, profile.txt and card.txt under $OUT.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$root/.carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
OUT="${OUT:-$root/gpu-region-out}"
mkdir -p "$OUT" /tmp/region
bin=.carry/bin/bench_mini_engine_rank_share
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv |
  tee "$OUT/card.txt"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
export MOEBIUS_BENCH_MODEL=qwen3_235b MOEBIUS_BENCH_P=8
# An 80 GB card holds 40 of the 94 layers' share; an H200 all of them.
if [ "${mem:-0}" -lt 100000 ]; then export MOEBIUS_BENCH_LAYERS=40; fi
echo "layers: ${MOEBIUS_BENCH_LAYERS:-94 (all)}" | tee -a "$OUT/card.txt"
status=0
for l in ${1:-tp ep tp-dcp2 tep tep-dcp2}; do
  echo "== curves $l ($((SECONDS - t0)) s)" | tee -a "$OUT/curves.txt"
  MOEBIUS_BENCH_LAYOUTS=$l MOEBIUS_BENCH_SUMMARY="$OUT/region_$l.jsonl" \
    MOEBIUS_BENCH_BATCHES=1,2,4,8,16,32,48,64,96,128,192,256,384,512,768,1024,1536,2048 \
    MOEBIUS_BENCH_CONTEXTS=512,1024,2048,4096,8192,16384,32768 \
    timeout "${CURVE_TIMEOUT:-100}" "$bin" >>"$OUT/curves.txt" 2>&1 || status=1
  echo "   exit $? ($((SECONDS - t0)) s)" | tee -a "$OUT/curves.txt"
done
for l in ${1:-tp ep tp-dcp2 tep tep-dcp2}; do
  [ "${PROFILE:-1}" = 1 ] || break
  MINI_ENGINE_PROFILE=1 MOEBIUS_BENCH_STEPS=3 MOEBIUS_BENCH_LAYOUTS=$l \
    MOEBIUS_BENCH_SUMMARY=/tmp/region/p_$l.jsonl MOEBIUS_BENCH_BATCHES=2048 \
    MOEBIUS_BENCH_CONTEXTS=512 timeout "${PROFILE_TIMEOUT:-45}" "$bin" >>"$OUT/profile.txt" 2>&1 ||
    status=1
  cat /tmp/region/p_$l.jsonl >>"$OUT/profile.jsonl" 2>/dev/null
done
grep -h "crossover" "$OUT/curves.txt" | tail -40
echo "total $((SECONDS - t0)) s"
exit $status
