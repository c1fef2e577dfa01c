#!/usr/bin/env bash
# The GPU checks and measurements still owed by the open issues (2026-12-02), in one script for
# the device machine, from a carry built here with
#   scripts/carry-build test_mini_engine_gpu_hf test_mini_engine_gpu_runtime \
#     test_serving_soak_gpu test_kv_migration_gpu bench_mini_engine_rank_share \
#     bench_kv_migration_gpu bench_mini_engine_switch_under_load
# Each part writes into $OUT; parts: hf soak kv curves30 curves235 kvblocks runtime1 runtime2
# region_tp region_ep demo demo_base libtests compare (default: hf soak kv curves30 curves235
# kvblocks; the runtime and region ones each need most of a call).
# The step_curves_*.jsonl it writes go into docs/results as they are: the build compiles them
# in and the demo's priced clock then takes its decode steps from them.
#   hf        issue 21: checkpoints transformers wrote, streamed to the GPU runtime
#   soak      issue 22: the serving soak on the GPU runtime (virtual ranks)
#   kv        issue 25: KV migration per layout preset and random strides, and its rates
#   curves30  issue 20: per-rank TP/EP step curves, Qwen3-30B-A3B at P = 2 and 4
#   curves235 issue 20: the same for Qwen3-235B-A22B at P = 8 (the paper's deployment)
#   kvblocks  issue 19: the progressive switch at P = 4, 90% occupancy, KV kernel grid 16 / 0
#   runtime1  issue 19: test_mini_engine_gpu_runtime but its virtual-rank cases
#   runtime2  issue 19: its virtual-rank cases (switches beside the steps, Qwen3-30B-A3B layer
#             shapes). The whole file needs more than 7 minutes on one H200 (2026-12-02: 240 s
#             covered its first 8 test cases, 171 s not quite the last two): one call each, with
#             each test case's time (--durations)
#   region_tp issue 31: Qwen3-235B-A22B P = 8 step curves over the whole operating region, TP:
#   region_ep batch 1..2048 (with 48, 96, 192, 384, 768, 1536: the pools full) and context
#             512..32768, every point whose KV fits the rank's pool (EP in region_ep)
#   demo      issue 30: moebius_demo on the GPU runtime (greedy tokens of every run compared)
#   demo_base the same from the "before" build in .carry/base; prints both token digests
#   libtests  every carried GPU test but the GPU runtime's (the soak among them)
#   compare   issue 30's before/after (.carry/base against .carry/bin): the engine step
#             (scripts/compare-builds) and the switch under load (P = 2 virtual ranks)
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH="$root/.carry/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
# libnccl.so.2 where the CUDA toolkit has none: the nvidia-nccl wheel beside torch.
nccl_lib="$(python3 -c 'import nvidia.nccl as n, os; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null)"
[ -n "$nccl_lib" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$nccl_lib"
OUT="${OUT:-$root/gpu-check-out}"
mkdir -p "$OUT"
bin=.carry/bin
parts=("$@")
((${#parts[@]})) || parts=(hf soak kv curves30 curves235 kvblocks)
status=0
run() {  # name, timeout, command...
  local name=$1 limit=$2 began=$SECONDS
  shift 2
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - began)) s"
  tail -n 6 "$OUT/$name.txt"
  ((rc == 0)) || status=1
}
for p in "${parts[@]}"; do
  case $p in
    hf) run hf 300 "$bin/test_mini_engine_gpu_hf" ;;
    soak) run soak 400 "$bin/test_serving_soak_gpu" ;;
    kv)
      run kv_test 300 "$bin/test_kv_migration_gpu"
      MOEBIUS_BENCH_KV_PRESETS=present,vllm_flash_attn,vllm_flashinfer,sglang_mha \
        run kv_bench 400 "$bin/bench_kv_migration_gpu" --benchmark_out="$OUT/kv_presets.json" \
        --benchmark_out_format=json ;;
    curves30)
      for P in 2 4; do
        MOEBIUS_BENCH_MODEL=qwen3_30b MOEBIUS_BENCH_P=$P MOEBIUS_BENCH_SUMMARY="$OUT/step_curves_qwen3_30b_p${P}_h200x1.jsonl" \
          run "curves_qwen3_30b_p$P" 580 "$bin/bench_mini_engine_rank_share"
      done ;;
    curves235)
      MOEBIUS_BENCH_MODEL=qwen3_235b MOEBIUS_BENCH_P=8 MOEBIUS_BENCH_SUMMARY="$OUT/step_curves_qwen3_235b_p8_h200x1.jsonl" \
        run curves_qwen3_235b_p8 580 "$bin/bench_mini_engine_rank_share" ;;
    kvblocks)
      for k in 16 0; do
        MOEBIUS_BENCH_P=4 MOEBIUS_BENCH_KV_BLOCKS=$k MOEBIUS_BENCH_OCCUPANCY=0.9 \
          MOEBIUS_BENCH_GIB_PER_STEP=0.25,1 MOEBIUS_BENCH_SUMMARY="$OUT/p4_kvblocks$k.jsonl" \
          run "p4_kvblocks$k" 300 "$bin/bench_mini_engine_switch_under_load"
      done ;;
    region_tp | region_ep)
      MOEBIUS_BENCH_MODEL=qwen3_235b MOEBIUS_BENCH_P=8 MOEBIUS_BENCH_MODES=${p#region_} \
        MOEBIUS_BENCH_BATCHES=1,2,4,8,16,32,48,64,96,128,192,256,384,512,768,1024,1536,2048 \
        MOEBIUS_BENCH_CONTEXTS=512,1024,2048,4096,8192,16384,32768 \
        MOEBIUS_BENCH_SUMMARY="$OUT/step_region_qwen3_235b_p8_${p#region_}_h200x1.jsonl" \
        run "$p" 590 "$bin/bench_mini_engine_rank_share" ;;
    demo) run demo 300 "$bin/moebius_demo" --runtime gpu --out "$OUT/demo_out" ;;
    demo_base)  # the same demo from the "before" build (.carry/base, docs/GPU.md)
      run demo_base 300 .carry/base/moebius_demo --runtime gpu --out "$OUT/demo_base_out"
      echo "greedy-token digests, before | after:"
      paste <(grep -o 'digest [0-9a-f]*' "$OUT/demo_base.txt") <(grep -o 'digest [0-9a-f]*' "$OUT/demo.txt") ;;
    libtests)  # every carried GPU test but the GPU runtime's (its two parts above)
      TEST_TIMEOUT=240 OUT="$OUT" scripts/run-carried tests \
        '^test_(cuda_ipc|cuda_peer_transport|device_arena|kv_migration_gpu|kv_placement_gpu|mini_engine_gpu_(hf|kernels|model)|nccl_transport|peer_copy_kernel|serving_soak_gpu)$' \
        >"$OUT/libtests.txt" 2>&1 || status=1
      grep -E '^(PASS|FAIL|SKIP|tests:)' "$OUT/libtests.txt" ;;
    compare)  # issue 30's before/after: the engine step and the switch under load
      MOEBIUS_BENCH_MAX_BATCH=64 REPEATS=2 OUT="$OUT/compare" scripts/compare-builds \
        bench_mini_engine_step >"$OUT/compare_step.txt" 2>&1 || status=1
      tail -n 30 "$OUT/compare_step.txt"
      for i in 1 2; do for side in base bin; do
        MOEBIUS_BENCH_P=2 MOEBIUS_BENCH_BATCHES=16 MOEBIUS_BENCH_OCCUPANCY=0.25,0.9 \
          MOEBIUS_BENCH_GIB_PER_STEP=0.5,2 MOEBIUS_BENCH_SUMMARY="$OUT/sul_${side}_$i.jsonl" \
          timeout 240 ".carry/$side/bench_mini_engine_switch_under_load" \
          >"$OUT/sul_${side}_$i.txt" 2>&1 || { status=1; echo "sul $side $i failed"; }
      done; done ;;
    runtime1) run runtime1 590 "$bin/test_mini_engine_gpu_runtime" "~[virtual]" --durations yes ;;
    runtime2) run runtime2 590 "$bin/test_mini_engine_gpu_runtime" "[virtual]" --durations yes ;;
    *) echo "unknown part $p"; status=2 ;;
  esac
done
exit $status
