# One entry per thing a user does. Every target sets itself up: uv (bootstrapped with pip if absent)
# installs the locked environment into .venv on first use.
SHELL := /bin/bash
UV := $(shell command -v uv 2>/dev/null || echo uv-missing)
PY := .venv/bin/python
# The GPU targets run on a lent machine's own python3 (torch and Triton preinstalled; no uv sync, no .venv there).
GPU_PY ?= $(shell test -x .venv/bin/python && echo .venv/bin/python || echo python3)
export HF_HUB_OFFLINE := 1
export PYTHONUNBUFFERED := 1

.PHONY: setup test train lint bench gpu-check gpu-bench clean

.venv/.synced: pyproject.toml uv.lock
	@if [ "$(UV)" = "uv-missing" ]; then python3 -m pip install -q uv; fi
	uv sync --frozen --compile-bytecode  # .pyc at install: imports (every spawned rank) 2x faster where PYTHONDONTWRITEBYTECODE is set
	@touch $@

setup: .venv/.synced

test: .venv/.synced  # one worker per core (tests pin torch to one thread each), a file's tests on one worker
	$(PY) -m pytest -q --numprocesses=auto --maxprocesses=4 --dist=loadfile tests

train: .venv/.synced
	$(PY) run.py recipe=lra_listops $(ARGS)

lint: .venv/.synced
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

bench: .venv/.synced
	$(PY) -m bench.block
	$(PY) -m bench.cema
	$(PY) -m bench.cpu_bar
	$(PY) -m bench.kernels

gpu-check:  # correctness on one H100, < 10 min: writes bench/GPU_CHECK.md; exits 2 without CUDA
	$(GPU_PY) -m bench.gpu_check $(ARGS)

gpu-bench:  # speed vs roofline and targets, < 5 min on a fresh H100: writes bench/GPU_RESULTS.md; exits 2 without CUDA
	$(GPU_PY) -m bench.gpu_bench $(ARGS)

clean:
	rm -rf .venv .pytest_cache
