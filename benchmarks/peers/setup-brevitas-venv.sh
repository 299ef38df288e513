#!/usr/bin/env bash
# Brevitas's own environment for benchmarks/peers/brevitas_mxfp4.py's `run` step.
# Brevitas's LLM example (its `llm` extra) pulls onnx, onnxruntime, optimum and gguf 0.18,
# which torq's environment does not need; torq goes in without its dependencies, for its
# perplexity only.
# Usage: bash benchmarks/peers/setup-brevitas-venv.sh [VENV]   (default /work/brevitas-venv)
set -euo pipefail

VENV=${1:-/work/brevitas-venv}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PIP="$VENV/bin/pip"

python3 -m venv "$VENV"
# torch first and alone, so that nothing after it can swap in a CUDA build.
"$PIP" install torch==2.13.0
"$PIP" install -c <(echo "torch==2.13.0") "brevitas[llm]==0.13.4" onnxscript
"$PIP" install --no-deps -e "$REPO"
