#!/usr/bin/env bash
# Every GPU measurement and GPU-only test of torq in one run, for a machine lent for a few
# minutes (about 8 on an H200): the GPU tests first (their log), then benchmarks/gpu.py's
# calibration parts (the default recipe exact and in TF32, TORQ's solvers on the CPU and on
# the GPU) and W4A4 decoding, then the intra-block solver on the CPU against the GPU.
# Each step writes under OUT as it finishes, so a run cut short keeps what it did.
#
#   OUT=results/gpu bash benchmarks/gpu_checks.sh        # OUT: where the records go
#   BUDGET_S=300 ...                                      # no gpu.py part starts after it
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT to a folder for the records}"
BUDGET_S="${BUDGET_S:-300}"
PY="${PYTHON:-python}"
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU here'" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1

step() { echo "[$(date +%T)] $*"; }

step "GPU tests"
# the kernels' whole suite on the GPU (elsewhere it runs in Triton's interpreter), then the
# tests that skip without a GPU: CPU against GPU runs, GPTQ's graphed loop, formats on CUDA
"$PY" -m pytest -q -rs tests/kernels > "$OUT/pytest-kernels-gpu.txt" 2>&1
tail -3 "$OUT/pytest-kernels-gpu.txt"
"$PY" -m pytest -q -rs -k "gpu or cuda" tests/test_cli.py tests/test_api.py \
    tests/surgery/test_gptq.py tests/formats/test_formats_fake_quant.py \
    > "$OUT/pytest-gpu.txt" 2>&1
tail -3 "$OUT/pytest-gpu.txt"

step "benchmarks/gpu.py"
"$PY" benchmarks/gpu.py --out "$OUT" --layers 2 --budget-s "$BUDGET_S" \
    --parts calibration,calibration-tf32,torq+gptq,torq+gptq-device-solvers,decode \
    > "$OUT/gpu.log" 2>&1
tail -2 "$OUT/gpu.log"

step "benchmarks/intra_speed.py --cuda"
"$PY" benchmarks/intra_speed.py --cuda --threads "$(nproc)" --repeats 1 --max-iter 5 --large \
    --out "$OUT/intra-cuda.json" > "$OUT/intra-cuda.log" 2>&1
tail -2 "$OUT/intra-cuda.log"
step "done"
