#!/usr/bin/env bash
# The GPU checks of the layouts and kernel changes, in one call on the device machine, from a
# carry built here with
#   scripts/carry-build test_mini_engine_gpu_kernels test_switch_layouts_gpu \
#     test_mini_engine_gpu_model test_kv_migration_gpu test_mini_engine_gpu_runtime moebius_demo \
#     bench_mini_engine_rank_share
# plus .carry/bin/bench_rank_share_before: the same bench built from the kernels before the
# router/combine change (the before/after runs in this one call, on one card).
#   tests    the GPU tests of the layouts' switches, the kernels, the model and KV migration
#   runtime  the GPU runtime serving TP attention with EP experts and the reverse (virtual ranks)
#   demo     moebius_demo on the GPU runtime: its greedy-token digests
#   profile  the rank-share stage profile, batch 2,048, context 512, before and after, every
#            layout (MOEBIUS_BENCH_LAYERS: 40 on an 80 GB card, 94 on an H200)
#   curves   every layout's curves (batch 1..2,048, context 512..32,768) with today's kernels
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$root/.carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
OUT="${OUT:-$root/gpu-check-out}"
mkdir -p "$OUT"
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
layers=$([ "${mem_mib:-0}" -gt 100000 ] && echo 94 || echo 40)
echo "layers: $layers"
for part in "${@:-tests runtime profile curves demo}"; do
  for p in $part; do
    t0=$SECONDS
    case $p in
      tests)
        TEST_TIMEOUT=240 OUT="$OUT" scripts/run-carried tests \
          '^test_(switch_layouts_gpu|mini_engine_gpu_(kernels|model)|kv_migration_gpu)$' \
          >"$OUT/tests.txt" 2>&1 || status=1
        grep -E '^(PASS|FAIL|SKIP|tests:)' "$OUT/tests.txt" ;;
      runtime)  # the GPU runtime in the mixed layouts (virtual ranks), eager
        timeout 240 .carry/bin/test_mini_engine_gpu_runtime "[layouts]" >"$OUT/runtime.txt" 2>&1 \
          || status=1
        tail -3 "$OUT/runtime.txt" ;;
      demo)
        timeout 300 .carry/bin/moebius_demo --runtime gpu --out "$OUT/demo_out" \
          >"$OUT/demo.txt" 2>&1 || status=1
        grep -o 'digest [0-9a-f]*' "$OUT/demo.txt" ;;
      profile)  # before and after the router/combine change, every layout, B 2048 ctx 512
        for build in before after; do
          bin=.carry/bin/bench_mini_engine_rank_share
          [ $build = before ] && bin=.carry/bin/bench_rank_share_before
          for l in tp tep ep tp-dcp2 tep-dcp2; do
            MOEBIUS_BENCH_MODEL=qwen3_235b MOEBIUS_BENCH_P=8 MOEBIUS_BENCH_LAYERS=$layers \
              MOEBIUS_BENCH_LAYOUTS=$l MOEBIUS_BENCH_CONTEXTS=512 MOEBIUS_BENCH_BATCHES=2048 \
              MINI_ENGINE_PROFILE=1 MOEBIUS_BENCH_STEPS=3 \
              MOEBIUS_BENCH_SUMMARY="$OUT/profile_$build.jsonl.part" \
              timeout 60 "$bin" >>"$OUT/profile_$build.txt" 2>&1 || status=1
            cat "$OUT/profile_$build.jsonl.part" >>"$OUT/profile_$build.jsonl" 2>/dev/null
            rm -f "$OUT/profile_$build.jsonl.part"
          done
        done ;;
      curves)  # every layout's curves with the kernels as they are now
        for l in tp ep tep-dcp2 tp-dcp2 tep; do
          MOEBIUS_BENCH_MODEL=qwen3_235b MOEBIUS_BENCH_P=8 MOEBIUS_BENCH_LAYERS=$layers \
            MOEBIUS_BENCH_LAYOUTS=$l MOEBIUS_BENCH_BATCHES=1,4,16,64,256,1024,2048 \
            MOEBIUS_BENCH_CONTEXTS=512,2048,8192,32768 MOEBIUS_BENCH_SUMMARY="$OUT/c_$l.jsonl" \
            timeout 100 .carry/bin/bench_mini_engine_rank_share >>"$OUT/curves.txt" 2>&1 || status=1
          cat "$OUT/c_$l.jsonl" >>"$OUT/curves.jsonl" 2>/dev/null
        done ;;
    esac
    echo "== $p: $((SECONDS - t0)) s"
  done
done
exit $status
