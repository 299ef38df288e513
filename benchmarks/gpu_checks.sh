#!/usr/bin/env bash
# Every GPU measurement and GPU-only test of torq in one run, for a machine lent for a few
# minutes, most important first, each step cut to the time left before DEADLINE_S: W4A4
# decoding (eager, graphed, compiled and graphed) through benchmarks/gpu.py; with MODEL, a
# real model's checkpoint served and decoded on the kernels and its default recipe in exact
# and TF32 arithmetic; the kernels' suite compiled for the GPU and the tests that skip
# without one; the default recipe's calibration (TF32 and exact) and TORQ's solvers on the
# GPU against the CPU; one layer's steps (loading, capture, solving) on both; then the
# intra-block solver both ways.
# Each step writes under OUT/records as it finishes; at the end everything is packed into
# OUT/records.tgz (a lent machine returns few files), so a run cut short keeps what it did.
#
#   OUT=results/gpu bash benchmarks/gpu_checks.sh        # OUT: where the records go
#   DEADLINE_S=560 ...                                    # the whole run ends by then
#   MODEL=m.gguf DATA_DIR=data ...     # also a real model: its checkpoint on the kernels, and
#                                       # the default recipe in exact and TF32 arithmetic
#   ARITHMETICS=tf32 ...                # the real model's calibrations (default exact,tf32)
#   STEPS=decode,gpu-tests ...          # only these steps (default: all, in this order:
#                                       # decode, checkpoint, arithmetic, gpu-tests,
#                                       # kernel-tests, calibration, steps, intra)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT to a folder for the records}"
DEADLINE_S="${DEADLINE_S:-560}"
PY="${PYTHON:-python3}"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
R="$OUT/records"
mkdir -p "$R"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU here'" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpu.txt" 2>&1

STEPS="${STEPS:-decode,checkpoint,arithmetic,gpu-tests,kernel-tests,calibration,steps,intra}"
step() { echo "[$(date +%T), ${SECONDS} s] $*"; }
# wants STEP: whether STEPS names it
wants() { [[ ",$STEPS," == *",$1,"* ]]; }
# runs STEP: whether it will run (the real model's steps need MODEL)
runs() { wants "$1" && { [ -n "${MODEL:-}" ] || [[ "$1" != checkpoint && "$1" != arithmetic ]]; }; }
ORDER=(decode checkpoint arithmetic gpu-tests kernel-tests calibration steps intra)
# the seconds each step is kept at least, out of the time of the steps before it
declare -A RESERVE=([decode]=0 [checkpoint]=60 [arithmetic]=70 [gpu-tests]=70
    [kernel-tests]=30 [calibration]=80 [steps]=0 [intra]=10)
# left STEP: the seconds STEP may run: those before the deadline, less what the wanted steps
# after it keep (floored at 1)
left() {
    local after=0 seen=0 s
    for s in "${ORDER[@]}"; do
        if [ "$seen" = 1 ] && runs "$s"; then after=$((after + RESERVE[$s])); fi
        [ "$s" = "$1" ] && seen=1
    done
    local l=$((DEADLINE_S - SECONDS - after)); echo $((l > 1 ? l : 1))
}

if wants decode; then
step "benchmarks/gpu.py: decoding, eager, graphed, compiled and graphed"
timeout "$(left decode)" "$PY" -m benchmarks.gpu --out "$R/gpu-decode" --parts decode \
    --compiled > "$R/gpu-decode.log" 2>&1
tail -2 "$R/gpu-decode.log"
fi

if runs checkpoint; then
    step "benchmarks/gpu.py: $MODEL saved, served and decoded on the kernels"
    timeout "$(left checkpoint)" "$PY" -m benchmarks.gpu --out "$R/gpu-checkpoint" \
        --parts checkpoint \
        --model "$MODEL" --data-dir "${DATA_DIR:?set DATA_DIR with MODEL}" \
        > "$R/gpu-checkpoint.log" 2>&1
    tail -1 "$R/gpu-checkpoint.log"
fi
if runs arithmetic; then
    step "benchmarks/gpu.py: the default recipe on $MODEL, exact and TF32 calibration"
    timeout "$(left arithmetic)" "$PY" -m benchmarks.gpu --out "$R/gpu-arithmetic" \
        --parts arithmetic \
        --model "$MODEL" --data-dir "$DATA_DIR" --calib-samples 128 --eval-windows 1000 \
        --arithmetics "${ARITHMETICS:-exact,tf32}" > "$R/gpu-arithmetic.log" 2>&1
    tail -1 "$R/gpu-arithmetic.log"
fi

if wants gpu-tests; then
# the tests that skip without a GPU: CPU against GPU runs, GPTQ's graphed loop, formats on CUDA
step "GPU-only tests"
timeout "$(left gpu-tests)" "$PY" -m pytest -q -rs -k "gpu or cuda" tests/test_cli.py \
    tests/test_api.py tests/surgery/test_gptq.py tests/formats/test_formats_fake_quant.py \
    tests/calibration/test_capture.py tests/models/test_decoding.py \
    tests/kernels/test_accelerate.py > "$R/pytest-gpu.txt" 2>&1
tail -1 "$R/pytest-gpu.txt"
fi
if wants kernel-tests; then
# the kernels' whole suite on the GPU (elsewhere it runs in Triton's interpreter)
step "the kernels' tests on the GPU"
timeout "$(left kernel-tests)" "$PY" -m pytest -q -rs tests/kernels \
    > "$R/pytest-kernels-gpu.txt" 2>&1
tail -1 "$R/pytest-kernels-gpu.txt"
fi

if wants calibration; then
step "benchmarks/gpu.py: calibration (TF32, exact), TORQ's solvers on the GPU and the CPU"
timeout "$(left calibration)" "$PY" -m benchmarks.gpu --out "$R/gpu-calibration" --layers 2 \
    --budget-s 200 --parts calibration-tf32,calibration,torq+gptq-device-solvers,torq+gptq \
    > "$R/gpu-calibration.log" 2>&1
tail -2 "$R/gpu-calibration.log"
fi

if wants steps && [ "$(left steps)" -gt 120 ]; then
    step "benchmarks/gpu.py: one layer's steps on the GPU and the CPU"
    timeout "$(left steps)" "$PY" -m benchmarks.gpu --out "$R/gpu-steps" --parts steps \
        > "$R/gpu-steps.log" 2>&1
    tail -2 "$R/gpu-steps.log"
fi

if wants intra && [ "$(left intra)" -gt 60 ]; then
    step "benchmarks/intra_speed.py --cuda"
    timeout "$(left intra)" "$PY" -m benchmarks.intra_speed --cuda --threads "$(nproc)" \
        --repeats 1 --max-iter 5 --large --out "$R/intra-cuda.json" > "$R/intra-cuda.log" 2>&1
    tail -2 "$R/intra-cuda.log"
fi
tar -czf "$OUT/records.tgz" -C "$OUT" records && rm -rf "$R"
step "done"
