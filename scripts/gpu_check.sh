#!/usr/bin/env bash
# gpu_check.sh [LOGDIR [BENCH ARGS...]]: the checks that need a CUDA GPU, logged to LOGDIR (default $OUT,
# else ./gpu_logs). Arguments after LOGDIR go to the benches of `tiny` models, e.g. trained checkpoints:
#   scripts/gpu_check.sh logs --ckpt out/ar-tiny/ckpt.pt --draft out/ar-draft/ckpt.pt --drafter out/dflash-tiny/ckpt.pt
#
# In order (the most wanted first, since a short budget cuts the last):
#   1. tests/test_kernels.py (each kernel against its reference), tests/test_kernel_paths.py (the
#      model paths with and without the kernels) and tests/test_kernels_fp4.py (the MXFP4 expert
#      kernel and its model path), the kernels compiled for the GPU (TRITON_INTERPRET=0); then
#      tests/fast/test_cuda_graphs.py: the loops the bench times with --compile give the eager tokens on CUDA,
#      run no graph without its CUDA graph, and record none again after their first stories;
#   2. scripts/train_speed.py: the default `13m` recipe (64 windows of 256) for 200 steps on the local
#      sample text in bf16 and fp16 + scaler, eager and compiled: tokens/s, MFU, compile seconds, peak
#      memory, and the default run's projected hours here and on a T4;
#   3. python -m tinydiff.bench.kernels $KERNEL_BENCH_ARGS (default: --kernels moe,moe-fp4 --no-flex,
#      the grouped expert kernel and the packed-FP4 one at the same routing; "--sweep" for every
#      kernel at other tile sizes too, as the first GPU run did);
#   4. the method bench eager on `tiny` (ar, spec-k4, dflash-b8, dflash-b16, ddtree-n32), then with
#      --compile (the eager loops on compiled steps, CUDA graphs): ar, spec-k4, dflash-b8, dflash-b16,
#      ddtree-n32, beside the one-graph paths ar-steps8 (8 AR tokens a graph call: fused_steps.py),
#      spec-k4-fused and dflash-b16-fused (each round one graph: fused_round.py, fused_dflash.py):
#      tokens/s, compile seconds, per-round microseconds; then scripts/compiled_step_costs.py on `tiny`
#      and `13m`: one compiled ar step taken apart (graph replay, device time, wrapper, sampling, the
#      eager step); scripts/compiled_round_costs.py on `tiny` and `13m`: spec-k4's and dflash-b16's
#      fused rounds taken apart the same way, each in compiled ar tokens; then FR-Spec's fused rounds
#      (ar, spec-k2-fr, spec-k3-fr at T = 1, interleaved, with the sample text for FR-Spec's ids);
#   5. ar on an untrained `13m`, eager and compiled (and ar-steps8 compiled);
#   6. python -m tinydiff.bench --new-tokens 32 --prompts 2 on tiny models at temperature 0 and 1 (every
#      method, the kernels in the model paths), where the budget leaves time.
# Needs nothing from the network (tiktoken's GPT-2 ranks come from TIKTOKEN_CACHE_DIR,
# ../shared/tiktoken-cache or ./shared/tiktoken-cache; without them the benches and training are
# skipped). Each step has a time limit, and the whole script ends within GPU_CHECK_BUDGET seconds
# (default 560, under one device call's 10 minutes): a step gets what is left of the budget at most,
# and a step with under 20 s left is skipped. A step that fails or times out is reported and the
# others still run. GPU_CHECK_STEPS="NAME ..." runs only the steps named (test_kernels test_cuda_graphs
# train_speed kernel_bench bench_eager bench_compile step_costs_tiny round_costs_tiny step_costs_13m round_costs_13m
# bench_compile_fr bench_13m_eager bench_13m bench bench_t1;
# they still run in this order). GPU_CHECK_TAR=FILE writes every log so far into one archive after each
# step: a device call that brings back only a few files (8 here) brings back that one, whole, even when
# the call's time limit cuts the script (so give a LOGDIR outside the folder it brings back).
# Exit status: 0 if every step that ran passed. Without a CUDA GPU it says so and exits 0.
set -u
cd "$(dirname "$0")/.."
LOGDIR="${1:-${OUT:-./gpu_logs}}"
shift $(( $# > 0 ? 1 : 0 ))
PY="${PYTHON:-$(command -v python || command -v python3)}"
mkdir -p "$LOGDIR"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# A folder counts only if it holds r50k_base (tiktoken names the file by the sha1 of its URL): an
# image may set TIKTOKEN_CACHE_DIR to a cache of other encodings.
R50K=0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4
FOUND=""
for dir in "${TIKTOKEN_CACHE_DIR:-}" ../shared/tiktoken-cache ./shared/tiktoken-cache; do
    if [ -n "$dir" ] && [ -f "$dir/$R50K" ]; then FOUND="$dir"; break; fi
done
if [ -n "$FOUND" ]; then export TIKTOKEN_CACHE_DIR="$FOUND"; else unset TIKTOKEN_CACHE_DIR; fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA GPU here: nothing to check (the kernels' CPU tests run under the interpreter in pytest)" \
        | tee "$LOGDIR/summary.txt"
    exit 0
fi

{
    date -u
    nvidia-smi 2>&1 || true
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
    echo "TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-(none with r50k_base)}"
} > "$LOGDIR/env.txt" 2>&1

status=0
BUDGET="${GPU_CHECK_BUDGET:-560}"
: > "$LOGDIR/summary.txt"
bundle() {  # with GPU_CHECK_TAR: the logs so far into one archive, replaced whole (a cut call keeps the last)
    [ -n "${GPU_CHECK_TAR:-}" ] || return 0
    tar czf "$GPU_CHECK_TAR.part" --exclude="$(basename "$GPU_CHECK_TAR")*" -C "$LOGDIR" . \
        && mv -f "$GPU_CHECK_TAR.part" "$GPU_CHECK_TAR"  # the archive left out of itself, wherever it lies
}
step() {  # step NAME SECONDS COMMAND...: run with a time limit (capped by the budget), log, record the outcome
    local name=$1 limit=$2; shift 2
    if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then return; fi
    local left=$((BUDGET - SECONDS - 5))
    if [ "$left" -lt 20 ]; then
        printf '%-14s %-16s\n' "$name" "SKIPPED (budget)" | tee -a "$LOGDIR/summary.txt"; return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local start=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=5 "$limit" "$@" > "$LOGDIR/$name.log" 2>&1
    local rc=$?
    local verdict=ok
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="TIMED OUT"; status=1
    elif [ $rc -ne 0 ]; then verdict="FAILED (rc $rc)"; status=1; fi
    printf '%-14s %-16s %4ds  %s\n' "$name" "$verdict" $((SECONDS - start)) "$LOGDIR/$name.log" | tee -a "$LOGDIR/summary.txt"
    tail -n 3 "$LOGDIR/$name.log"
    bundle
}

TRITON_INTERPRET=0 step test_kernels 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    tests/test_kernel_paths.py tests/test_kernels_fp4.py
TRITON_INTERPRET=0 step test_cuda_graphs 150 env TORCH_LOGS=cudagraphs "$PY" -m pytest -v -p no:cacheprovider -n 0 \
    tests/fast/test_cuda_graphs.py  # -v: each test's verdict as it ends, kept if the limit cuts the rest
# The rows are written as they come: a timeout keeps them.
# shellcheck disable=SC2086  # the arguments are words
DATA=""
for file in ../shared/data/tinystories-sample.txt ./shared/data/tinystories-sample.txt; do
    if [ -f "$file" ]; then DATA="$file"; break; fi
done
if [ -n "$DATA" ] && [ -n "${TIKTOKEN_CACHE_DIR:-}" ]; then  # the default 13m recipe: tok/s, MFU, the T4 hour
    step train_speed 300 "$PY" scripts/train_speed.py --data "$DATA" --steps 200 --dtypes bf16,fp16
else
    echo "train_speed    SKIPPED: no tinystories-sample.txt beside the repo or no tiktoken cache" \
        | tee -a "$LOGDIR/summary.txt"
fi
step kernel_bench 120 "$PY" -m tinydiff.bench.kernels ${KERNEL_BENCH_ARGS:---kernels moe,moe-fp4 --no-flex} \
    --json "$LOGDIR/kernel_bench.json"
if [ -z "${TIKTOKEN_CACHE_DIR:-}" ]; then
    echo "benches      SKIPPED: no tiktoken cache (set TIKTOKEN_CACHE_DIR to a folder with the r50k_base ranks)" \
        | tee -a "$LOGDIR/summary.txt"
    bundle; echo "logs in $LOGDIR"; exit $status
fi
step bench_eager 60 "$PY" -m tinydiff.bench --new-tokens 64 --prompts 2 \
    --methods ar,spec-k4,dflash-b8,dflash-b16,ddtree-n32 --json "$LOGDIR/bench_eager.json" "$@"
# TORCH_LOGS=cudagraphs: the log says when inductor skips CUDA graphs or records one again, and why.
step bench_compile 240 env TORCH_LOGS=cudagraphs "$PY" -m tinydiff.bench \
    --methods ar,ar-steps8,spec-k4,spec-k4-fused,dflash-b8,dflash-b16,dflash-b16-fused,ddtree-n32 --new-tokens 64 \
    --prompts 2 --compile --json "$LOGDIR/bench_compile.json" "$@"
for preset in tiny 13m; do
    # where a compiled step's time goes (graph, wrapper, sampling), then a fused round's (graph replay,
    # device, read-back, host) in compiled ar tokens
    step "step_costs_$preset" 60 "$PY" scripts/compiled_step_costs.py --preset "$preset"
    step "round_costs_$preset" 90 "$PY" scripts/compiled_round_costs.py --preset "$preset"
done
if [ -n "$DATA" ]; then  # the fused rounds (fused_round.py), whole rounds as one graph; FR-Spec ranks --data's ids
    step bench_compile_fr 120 "$PY" -m tinydiff.bench --methods ar,spec-k2-fr,spec-k3-fr --new-tokens 64 --prompts 4 \
        --compile --temperature 1 --interleave --data "$DATA" --json "$LOGDIR/bench_compile_fr.json" "$@"
fi
M13="${TMPDIR:-/tmp}/tinydiff-gpu-13m.pt"
"$PY" -c "import sys, torch; from tinydiff.model import Transformer, preset; from tinydiff.io.checkpoint import save_checkpoint
c = preset('13m'); torch.manual_seed(0); save_checkpoint(sys.argv[1], kind='ar', config=c, model=Transformer(c))" "$M13"
step bench_13m_eager 45 "$PY" -m tinydiff.bench --ckpt "$M13" --methods ar --new-tokens 64 --prompts 2 \
    --json "$LOGDIR/bench_13m_eager.json"
step bench_13m 120 "$PY" -m tinydiff.bench --ckpt "$M13" --methods ar,ar-steps8 --new-tokens 64 --prompts 2 --compile \
    --json "$LOGDIR/bench_13m.json"
step bench 90 "$PY" -m tinydiff.bench --new-tokens 32 --prompts 2 --json "$LOGDIR/bench.json" "$@"
step bench_t1 90 "$PY" -m tinydiff.bench --new-tokens 32 --prompts 2 --temperature 1 \
    --json "$LOGDIR/bench_t1.json" "$@"  # where users sample: acceptance by slot per row
bundle
echo "logs in $LOGDIR"
exit $status
