#!/usr/bin/env bash
# The measurements that need an H200's memory, in one call on the GPU machine (~500 s): every
# static layout's full-size (94-layer) step curves over the operating region
# (scripts/gpu-region-curves.sh, no stage profile) and the simulated runtime's fidelity against
# the GPU runtime at P = 1 and 2 (mini_engine_fidelity, 8 layers, seed 1).
# Built here with
#   scripts/carry-build bench_mini_engine_rank_share mini_engine_fidelity
# and on the GPU machine (kind nvidia-h200, carry .carry):
#   OUT=<dir> scripts/gpu-h200-measurements.sh
# Writes under $OUT: card.txt, fidelity/ (layers8_seed1_p{1,2}.{json,txt} and logs) and the
# region curves' files (region_<layout>.jsonl, curves.txt), packed into h200.tgz as well.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$root/.carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
OUT="${OUT:-$root/gpu-h200-out}"
mkdir -p "$OUT/fidelity" "$OUT/region"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/card.txt"
status=0
for p in 1 2; do
  MOEBIUS_FIDELITY_LAYERS=8 MOEBIUS_FIDELITY_SEED=1 MOEBIUS_FIDELITY_P=$p OUT="$OUT/fidelity" \
    timeout 100 .carry/bin/mini_engine_fidelity >"$OUT/fidelity/p$p.log" 2>&1 || status=1
  echo "fidelity P=$p done ($SECONDS s)"
done
PROFILE=0 CURVE_TIMEOUT="${CURVE_TIMEOUT:-75}" OUT="$OUT/region" \
  timeout 380 scripts/gpu-region-curves.sh >"$OUT/region/run.log" 2>&1 || status=1
grep -h "== curves\|exit" "$OUT/region/curves.txt"
tar czf "$OUT/h200.tgz" -C "$OUT" card.txt fidelity region
echo "total $SECONDS s"
exit $status
