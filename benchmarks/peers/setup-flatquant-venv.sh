#!/usr/bin/env bash
# FlatQuant's own environment for benchmarks/peers/flatquant_mxfp4.py's `run` step.
# FlatQuant pins transformers 4.45 (its model wrappers subclass that version's Llama
# attention), older than torq's floor, so it gets a virtual environment of its own; torq goes
# in without its dependencies, for its MXFP4 formats and its perplexity only.
# Usage: bash benchmarks/peers/setup-flatquant-venv.sh [VENV]   (default /work/flatquant-venv)
set -euo pipefail

VENV=${1:-/work/flatquant-venv}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PIP="$VENV/bin/pip"

python3 -m venv "$VENV"
# torch first and alone, so that nothing after it can swap in a CUDA build.
"$PIP" install torch==2.13.0
"$PIP" install -c <(echo "torch==2.13.0") transformers==4.45.0 accelerate==0.32.0 \
    numpy scipy tqdm safetensors sentencepiece
"$PIP" install --no-deps -e "$REPO"
