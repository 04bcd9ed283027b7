#!/usr/bin/env bash
# The GPU measurements of the reasoning workload that are still open, in groups that each fit one
# device command (at most 10 minutes, most about 4):
#
#   bash bench/gpu_round.sh numerics   # engine vs trainer log-probs: the Triton path's variants, both shapes
#   bash bench/gpu_round.sh tail       # the few-row decode step (the attention kernel's speed)
#   bash bench/gpu_round.sh reasoning  # the 1.5B reasoning step at cap 8k and 2k, same lengths every run
#   bash bench/gpu_round.sh tailcut    # the 1.5B step with the rollout's tail carried over, beside the defaults
#                                      # (TAILCUT_STEPS measured steps, TAILCUT_VARIANTS e.g. "defaults tail8c1024s264 c0")
#   bash bench/gpu_round.sh short      # tailcut (2 measured steps each), Qwen3's numerics, then profile
#   bash bench/gpu_round.sh last       # Qwen3's numerics, then profile (about four minutes)
#   bash bench/gpu_round.sh alloc      # the cap-2,048 step with and without the allocator's expandable segments
#   bash bench/gpu_round.sh verify     # the update's no-sync and bf16 fold tests, profile, cap 2,048 with flash SDPA
#   bash bench/gpu_round.sh one        # the CUDA-only kernel and no-sync tests, then tailcut (2 steps, defaults and tail8)
#   bash bench/gpu_round.sh rounding   # the kernel's roundings on CUDA: RoPE probe, kernel tests, both shapes' numerics, tail step
#   bash bench/gpu_round.sh pv         # numerics and the tail step with the probabilities kept wide for the value product
#   bash bench/gpu_round.sh checks     # cap 2,048 with flash SDPA, then with the defaults
#   bash bench/gpu_round.sh single     # the single-turn step beside a reference wheel (.whl/ref/), same machine
#   bash bench/gpu_round.sh tests      # the CUDA-only tests of the kernels and the update's memory
#   bash bench/gpu_round.sh profile    # the cap-2,048 step, then its update under the profiler: where the GPU idles
#   bash bench/gpu_round.sh big        # the 7B reasoning step (needs an H200's memory)
#
# Results and logs go to $OUT (default: a new temporary directory). On a machine without rlcore's
# dependencies, source bench/device_env.sh first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
export OUT
run() {  # run NAME SECONDS COMMAND...: the command under a time limit, its log in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $?"
    grep -v DEBUG "$OUT/$name.log" | tail -8
}
case "${1:-}" in
    numerics)
        run kernel_fold 60 python3 -m pytest -q -p no:logging tests/unit/test_rollout_decode_attention.py -k folds_the_new
        run check_models_qwen3 200 python3 bench/check_models.py --shapes qwen3-1.7b \
            --variants default,rope-apart,triton-eager,triton-eager-rope-apart,eager --prompts 8 --budget-s 20 \
            --out "$OUT/check_models_qwen3.json"
        run check_models_qwen25 120 python3 bench/check_models.py --shapes qwen2.5-1.5b --variants default,eager \
            --prompts 8 --budget-s 20 --out "$OUT/check_models_qwen25.json" ;;
    tail)
        run tail_step 120 python3 bench/bench_decode_parts.py --shapes qwen2-1.5b --batch 8 --parts none --loop \
            --loop-prompt 4096 --loop-new 257 --out "$OUT/tail_step.json" ;;
    reasoning)
        run reasoning_cap8k 230 python3 bench/bench_reasoning.py --shapes qwen2.5-1.5b --systems rlcore --warmup 2 \
            --steps 2 --numerics-prompts 0 --total-budget-s 220 --timeout-rlcore 220 --fixed-lengths \
            --out "$OUT/reasoning_cap8k.json"
        run reasoning_cap2k 160 python3 bench/bench_reasoning.py --shapes qwen2.5-1.5b --systems rlcore --cap 2048 \
            --mean-len 512 --warmup 2 --steps 1 --numerics-prompts 0 --total-budget-s 150 --timeout-rlcore 150 \
            --fixed-lengths --out "$OUT/reasoning_cap2k.json" ;;
    tailcut)  # the same drawn lengths in both (a carried sample keeps its own); samples trained a second compare
        for v in ${TAILCUT_VARIANTS:-defaults tail8}; do  # e.g. defaults, tail8, tail8c1024s264, c1024
            extra=()  # tailN: tail_rows=N; then cC: the attention kernel's chunks capped at C columns; sS: S engine slots
            [[ "$v" =~ ^tail([0-9]+) ]] && extra=(--rlcore-override "ppo.partial_rollout.tail_rows=${BASH_REMATCH[1]}"
                                                  --rlcore-override ppo.rollout_is=token)
            [[ "$v" =~ c([0-9]+) ]] && extra+=(--attention-max-chunk "${BASH_REMATCH[1]}")
            [[ "$v" =~ s([0-9]+)$ ]] && extra+=(--slots "${BASH_REMATCH[1]}")
            run "reasoning_$v" 280 python3 bench/bench_reasoning.py --shapes qwen2.5-1.5b --systems rlcore --warmup 2 \
                --steps "${TAILCUT_STEPS:-3}" --numerics-prompts 0 --total-budget-s 270 --timeout-rlcore 270 --fixed-lengths ${extra[@]+"${extra[@]}"} \
                --out "$OUT/reasoning_$v.json"
        done ;;
    profile)
        run reasoning_cap2k_profile 230 python3 bench/bench_reasoning.py --shapes qwen2.5-1.5b --systems rlcore \
            --cap 2048 --mean-len 512 --warmup 2 --steps 1 --numerics-prompts 0 --total-budget-s 220 \
            --timeout-rlcore 220 --fixed-lengths --profile-update --out "$OUT/reasoning_cap2k_profile.json" ;;
    short)  # one call, the most wanted first: the tail cut (2 measured steps each), Qwen3's numerics, the profile
        TAILCUT_STEPS=2 bash "$0" tailcut
        run check_models_qwen3 200 python3 bench/check_models.py --shapes qwen3-1.7b --variants default,eager,block-64 \
            --prompts 8 --budget-s 20 --out "$OUT/check_models_qwen3.json"
        bash "$0" profile ;;
    last)  # about four minutes: Qwen3's numerics, then the cap-2,048 update under the profiler
        run check_models_qwen3 150 python3 bench/check_models.py --shapes qwen3-1.7b --variants default,eager,block-64 \
            --prompts 8 --budget-s 20 --out "$OUT/check_models_qwen3.json"
        bash "$0" profile ;;
    alloc)  # the cap-2,048 step beside itself with PyTorch's expandable segments (the allocator's cache flushes)
        for v in defaults expandable; do
            env=()
            [ "$v" = expandable ] && env=(env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
            run "reasoning_cap2k_$v" 200 ${env[@]+"${env[@]}"} python3 bench/bench_reasoning.py --shapes qwen2.5-1.5b \
                --systems rlcore --cap 2048 --mean-len 512 --warmup 2 --steps 2 --numerics-prompts 0 \
                --total-budget-s 190 --timeout-rlcore 190 --fixed-lengths --out "$OUT/reasoning_cap2k_$v.json"
        done ;;
    verify)  # about four minutes: a micro-batch makes no synchronization, then the cap-2,048 update profiled
        run gpu_syncs 90 python3 -m pytest -q -p no:logging tests/gpu/test_gpu_update_syncs.py \
            tests/unit/test_rollout_decode_attention.py -k "no_sync or reads_nothing or folds_the_new"
        bash "$0" profile
        run reasoning_cap2k_flash 160 python3 bench/bench_reasoning.py --shapes qwen2.5-1.5b --systems rlcore \
            --cap 2048 --mean-len 512 --warmup 2 --steps 1 --numerics-prompts 0 --total-budget-s 150 \
            --timeout-rlcore 150 --fixed-lengths --rlcore-override "trainer.sdpa_backends=[flash,efficient]" \
            --out "$OUT/reasoning_cap2k_flash.json" ;;
    one)  # about eight minutes: the CUDA-only kernel and no-sync tests, then the tail cut beside the defaults
        run gpu_checks 100 python3 -m pytest -q -p no:logging tests/gpu/test_gpu_update_syncs.py \
            tests/unit/test_rollout_decode_attention.py
        run rope_fused_apart 60 python3 bench/probes/rope_fused_apart.py --json "$OUT/rope_fused_apart.json"
        TAILCUT_STEPS=2 TAILCUT_VARIANTS="defaults tail8" bash "$0" tailcut ;;
    pv)  # about five minutes: the attention's probabilities kept wide for the value product (numerics, then speed)
        for shape in qwen3-1.7b qwen2.5-1.5b; do
            run "check_models_$shape" 150 python3 bench/check_models.py --shapes "$shape" --variants default,pv-tf32,pv-ieee,eager \
                --prompts 8 --budget-s 20 --out "$OUT/check_models_$shape.json"
        done
        run tail_step_pv 150 python3 bench/bench_decode_parts.py --shapes qwen2-1.5b --batch 8 --parts none \
            --loop --loop-variants 'default;{"pv_precision": "tf32"};{"pv_precision": "ieee"}' --loop-prompt 4096 --loop-new 257 \
            --out "$OUT/tail_step_pv.json" ;;
    rounding)  # about five minutes: the attention kernel's roundings on CUDA (enable_fp_fusion off), then their cost
        run rope_fused_apart 60 python3 bench/probes/rope_fused_apart.py --json "$OUT/rope_fused_apart.json"
        run kernel_tests 120 python3 -m pytest -q -rfE --tb=line tests/gpu/test_gpu_update_syncs.py \
            tests/unit/test_rollout_decode_attention.py
        run check_models_qwen3 120 python3 bench/check_models.py --shapes qwen3-1.7b --variants default,eager \
            --prompts 8 --budget-s 20 --out "$OUT/check_models_qwen3.json"
        run check_models_qwen25 100 python3 bench/check_models.py --shapes qwen2.5-1.5b --variants default,eager \
            --prompts 8 --budget-s 20 --out "$OUT/check_models_qwen25.json"
        run tail_step_fp_fusion 120 python3 bench/bench_decode_parts.py --shapes qwen2-1.5b --batch 8 --parts none \
            --loop --loop-variants 'default;{"fp_fusion": true}' --loop-prompt 4096 --loop-new 257 \
            --out "$OUT/tail_step_fp_fusion.json" ;;
    checks)  # about six minutes
        run reasoning_cap2k_flash 160 python3 bench/bench_reasoning.py --shapes qwen2.5-1.5b --systems rlcore \
            --cap 2048 --mean-len 512 --warmup 2 --steps 1 --numerics-prompts 0 --total-budget-s 150 \
            --timeout-rlcore 150 --fixed-lengths --rlcore-override "trainer.sdpa_backends=[flash,efficient]" \
            --out "$OUT/reasoning_cap2k_flash.json"
        run reasoning_cap2k 160 python3 bench/bench_reasoning.py --shapes qwen2.5-1.5b --systems rlcore \
            --cap 2048 --mean-len 512 --warmup 2 --steps 1 --numerics-prompts 0 --total-budget-s 150 \
            --timeout-rlcore 150 --fixed-lengths --out "$OUT/reasoning_cap2k.json" ;;
    single)  # this checkout's wheel, the reference (.whl/ref/*.whl, its commit in .whl/ref/COMMIT), this one again
        ref=$(mktemp -d)
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$ref" .whl/ref/*.whl || exit 1
        for v in ${SINGLE_RUNS:-head ref head2}; do
            if [ "$v" = ref ]; then
                run "grpo_step_$v" 150 env PYTHONPATH="$ref:${PYTHONPATH:-}" RLCORE_BENCH_COMMIT="$(cat .whl/ref/COMMIT)" \
                    python3 bench/bench_grpo_step.py --systems rlcore --warmup 1 --steps 3 --out "$OUT/grpo_step_$v.json"
            else
                run "grpo_step_$v" 150 python3 bench/bench_grpo_step.py --systems rlcore --warmup 1 --steps 3 \
                    --out "$OUT/grpo_step_$v.json"
            fi
        done ;;
    tests)
        run gpu_tests 500 python3 -m pytest -q -p no:logging tests/gpu tests/unit/test_rollout_decode_attention.py ;;
    big)
        run reasoning_7b 560 python3 bench/bench_reasoning.py --shapes qwen2.5-7b --systems rlcore --warmup 1 \
            --steps 1 --numerics-prompts 0 --total-budget-s 540 --fixed-lengths --out "$OUT/reasoning_7b.json" ;;
    *)
        sed -n '2,/^set /p' "$0" | grep '^#'
        exit 2 ;;
esac
echo "results in $OUT"
