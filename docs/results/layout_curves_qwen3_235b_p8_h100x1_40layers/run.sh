#!/usr/bin/env bash
# layout curves: every layout's curves, then one profiled point per layout (B 2048, ctx 512).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
bin="$here/bench_mini_engine_rank_share"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/lc
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv | tee "$OUT/card.txt"
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
export MOEBIUS_BENCH_MODEL=qwen3_235b MOEBIUS_BENCH_P=8
if [ "${mem:-0}" -lt 100000 ]; then export MOEBIUS_BENCH_LAYERS=40; fi
echo "layers: ${MOEBIUS_BENCH_LAYERS:-94 (all)}" | tee -a "$OUT/card.txt"
layouts="${LAYOUTS:-tp ep tep-dcp2 tp-dcp2 tep}"
for l in $layouts; do
  echo "== curves $l ($((SECONDS - t0)) s)" | tee -a "$OUT/curves.txt"
  MOEBIUS_BENCH_LAYOUTS=$l MOEBIUS_BENCH_SUMMARY=/tmp/lc/c_$l.jsonl \
    MOEBIUS_BENCH_BATCHES=1,4,16,64,256,1024,2048 MOEBIUS_BENCH_CONTEXTS=512,2048,8192,32768 \
    timeout "${CURVE_TIMEOUT:-100}" "$bin" >>"$OUT/curves.txt" 2>&1
  echo "   exit $? ($((SECONDS - t0)) s)" | tee -a "$OUT/curves.txt"
  cat /tmp/lc/c_$l.jsonl >>"$OUT/curves.jsonl" 2>/dev/null
done
for l in $layouts; do
  echo "== profile $l ($((SECONDS - t0)) s)" | tee -a "$OUT/profile.txt"
  MINI_ENGINE_PROFILE=1 MOEBIUS_BENCH_STEPS=3 MOEBIUS_BENCH_LAYOUTS=$l \
    MOEBIUS_BENCH_SUMMARY=/tmp/lc/p_$l.jsonl MOEBIUS_BENCH_BATCHES=2048 MOEBIUS_BENCH_CONTEXTS=512 \
    timeout "${PROFILE_TIMEOUT:-45}" "$bin" >>"$OUT/profile.txt" 2>&1
  echo "   exit $? ($((SECONDS - t0)) s)" | tee -a "$OUT/profile.txt"
  cat /tmp/lc/p_$l.jsonl >>"$OUT/profile.jsonl" 2>/dev/null
done
grep -h "ctx\|rank:\|crossover\|could not" "$OUT/curves.txt" | tail -80
echo "total $((SECONDS - t0)) s"
# Optional: stage profiles where DCP should pay (long context), PROFILE2=1.
if [ "${PROFILE2:-0}" = 1 ]; then
  for l in tp tp-dcp2 tep-dcp2; do
    echo "== profile2 $l ($((SECONDS - t0)) s)" | tee -a "$OUT/profile2.txt"
    MINI_ENGINE_PROFILE=1 MOEBIUS_BENCH_STEPS=3 MOEBIUS_BENCH_LAYOUTS=$l \
      MOEBIUS_BENCH_SUMMARY=/tmp/lc/q_$l.jsonl MOEBIUS_BENCH_BATCHES=64,256 MOEBIUS_BENCH_CONTEXTS=8192 \
      timeout 45 "$bin" >>"$OUT/profile2.txt" 2>&1
    echo "   exit $? ($((SECONDS - t0)) s)" | tee -a "$OUT/profile2.txt"
    cat /tmp/lc/q_$l.jsonl >>"$OUT/profile2.jsonl" 2>/dev/null
  done
  echo "total $((SECONDS - t0)) s"
fi
