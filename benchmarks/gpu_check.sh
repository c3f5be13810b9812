#!/usr/bin/env bash
# The GPU check of issue 12 (item 5), in one go, sized for under 9 minutes on one H100/H200:
#   1. the kernel tests natively (TRITON_INTERPRET=0: the bf16/fp8 tl.dot paths and native fp8 casts run for real);
#   2. the engine end to end on CUDA (benchmarks/gpu_engine_check.py): greedy tokens of a SmolLM2-shaped Llama and a
#      tiny DeepSeek-V3 on the Triton kernels equal the CPU reference path's (fp32), CUDA-graph decode equal to eager,
#      and decode tokens/s with and without graphs;
#   3. benchmarks/kernel_speeds.py: GB/s, TFLOP/s and % of peak for the KV write, paged attention, MLA decode and fused MoE
#      at SmolLM2 and DeepSeek-V3 shapes, and the fp8 W8A8 / int4 dense linear layers against bf16 (issue 25),
#      batch 1-256;
#   4. benchmarks/dsa_decode.py: DeepSeek Sparse Attention's decode against dense MLA, 1k-64k tokens of context.
# Before it, here: `bash benchmarks/gpu_wheels.sh` (what the GPU machine lacks). Then, through the device tool:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl", ".gpu"], timeout_s=540)
# Everything lands in $OUT (the device tool's folder; benchmarks/results/gpu elsewhere). Exit 1 if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
TOKENIZER=()
[ -d .gpu/tokenizer ] && TOKENIZER=(--tokenizer .gpu/tokenizer)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
# Steps: all four by default, or those named (`bash benchmarks/gpu_check.sh tests engine`).
STEPS=" ${*:-tests engine speeds dsa} "
status=0
if [[ $STEPS == *" tests "* ]]; then
    # One pytest process per file, four at a time: a CUDA error is sticky, so in one process the first would fail
    # every later test on the GPU.
    mkdir -p "$OUT/kernel-tests"
    ls tests/kernels/test_*.py | xargs -P 4 -I{} sh -c \
        'timeout 240 python3 -m pytest -q -p no:cacheprovider {} > "$0/kernel-tests/$(basename {} .py).txt" 2>&1' \
        "$OUT" || status=1
    for f in "$OUT"/kernel-tests/*.txt; do echo "$(basename "$f" .txt): $(tail -1 "$f")"; done \
        | tee "$OUT/kernel-tests.txt"
    # One file back, not thirteen (the device tool returns a handful of files).
    tail -n +1 "$OUT"/kernel-tests/*.txt > "$OUT/kernel-tests-full.txt" && rm -r "$OUT/kernel-tests"
fi
if [[ $STEPS == *" engine "* ]]; then
    timeout 240 python3 benchmarks/gpu_engine_check.py --out "$OUT/engine.json" "${TOKENIZER[@]}" || status=1
fi
if [[ $STEPS == *" speeds "* ]]; then
    timeout 120 python3 benchmarks/kernel_speeds.py --json "$OUT/kernels.json" --reps 5 > "$OUT/kernels.txt" 2>&1 \
        || status=1
    tail -5 "$OUT/kernels.txt"
fi
if [[ $STEPS == *" dsa "* ]]; then  # DeepSeek Sparse Attention against dense MLA (issue 27): decode ms by context
    timeout 90 python3 benchmarks/dsa_decode.py --backend triton --contexts 1024,4096,16384,65536 --batches 1,16 \
        --out "$OUT/dsa-decode.json" > "$OUT/dsa-decode.txt" 2>&1 || status=1
    tail -3 "$OUT/dsa-decode.txt"
fi
exit $status
