#!/usr/bin/env bash
# Every GPU measurement and GPU-only test of torq in one run, for a machine lent for a few
# minutes, most important first, each step cut to the time left before DEADLINE_S: W4A4
# decoding (eager, graphed, compiled and graphed) through benchmarks/gpu.py; with MODEL, a
# real model's checkpoint served and decoded on the kernels and its default recipe in exact
# and TF32 arithmetic; the kernels' suite compiled for the GPU and the tests that skip
# without one; the default recipe's calibration (TF32 and exact) and TORQ's solvers on the
# GPU against the CPU; then the intra-block solver both ways.
# Each step writes under OUT/records as it finishes; at the end everything is packed into
# OUT/records.tgz (a lent machine returns few files), so a run cut short keeps what it did.
#
#   OUT=results/gpu bash benchmarks/gpu_checks.sh        # OUT: where the records go
#   DEADLINE_S=560 ...                                    # the whole run ends by then
#   MODEL=m.gguf DATA_DIR=data ...     # also a real model: its checkpoint on the kernels, and
#                                       # the default recipe in exact and TF32 arithmetic
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

step() { echo "[$(date +%T), ${SECONDS} s] $*"; }
# left SLACK: the seconds before the deadline, less SLACK (floored at 1)
left() { local l=$((DEADLINE_S - SECONDS - ${1:-0})); echo $((l > 1 ? l : 1)); }

step "benchmarks/gpu.py: decoding, eager, graphed, compiled and graphed"
timeout "$(left 330)" "$PY" benchmarks/gpu.py --out "$R/gpu-decode" --parts decode --compiled \
    > "$R/gpu-decode.log" 2>&1
tail -2 "$R/gpu-decode.log"

if [ -n "${MODEL:-}" ]; then
    step "benchmarks/gpu.py: $MODEL saved, served and decoded on the kernels"
    timeout "$(left 270)" "$PY" benchmarks/gpu.py --out "$R/gpu-checkpoint" --parts checkpoint \
        --model "$MODEL" --data-dir "${DATA_DIR:?set DATA_DIR with MODEL}" \
        > "$R/gpu-checkpoint.log" 2>&1
    tail -1 "$R/gpu-checkpoint.log"
    step "benchmarks/gpu.py: the default recipe on $MODEL, exact and TF32 calibration"
    timeout "$(left 200)" "$PY" benchmarks/gpu.py --out "$R/gpu-arithmetic" --parts arithmetic \
        --model "$MODEL" --data-dir "$DATA_DIR" --calib-samples 128 --eval-windows 1000 \
        > "$R/gpu-arithmetic.log" 2>&1
    tail -1 "$R/gpu-arithmetic.log"
fi

step "GPU tests"
# the kernels' whole suite on the GPU (elsewhere it runs in Triton's interpreter), then the
# tests that skip without a GPU: CPU against GPU runs, GPTQ's graphed loop, formats on CUDA
timeout "$(left 170)" "$PY" -m pytest -q -rs tests/kernels > "$R/pytest-kernels-gpu.txt" 2>&1
tail -1 "$R/pytest-kernels-gpu.txt"
timeout "$(left 100)" "$PY" -m pytest -q -rs -k "gpu or cuda" tests/test_cli.py \
    tests/test_api.py tests/surgery/test_gptq.py tests/formats/test_formats_fake_quant.py \
    tests/calibration/test_capture.py > "$R/pytest-gpu.txt" 2>&1
tail -1 "$R/pytest-gpu.txt"

step "benchmarks/gpu.py: calibration (TF32, exact), TORQ's solvers on the GPU and the CPU"
timeout "$(left 20)" "$PY" benchmarks/gpu.py --out "$R/gpu-calibration" --layers 2 \
    --budget-s 200 --parts calibration-tf32,calibration,torq+gptq-device-solvers,torq+gptq \
    > "$R/gpu-calibration.log" 2>&1
tail -2 "$R/gpu-calibration.log"

if [ "$(left)" -gt 60 ]; then
    step "benchmarks/intra_speed.py --cuda"
    timeout "$(left 10)" "$PY" benchmarks/intra_speed.py --cuda --threads "$(nproc)" \
        --repeats 1 --max-iter 5 --large --out "$R/intra-cuda.json" > "$R/intra-cuda.log" 2>&1
    tail -2 "$R/intra-cuda.log"
fi
tar -czf "$OUT/records.tgz" -C "$OUT" records && rm -rf "$R"
step "done"
