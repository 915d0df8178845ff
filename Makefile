PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: install test test-slow run check-gpu gpu-session bench bench-estimate bench-gpu clean

install:  ## make .venv and install the package editable with its dev extras
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[dev]'

test:  ## the fast suite on two workers, a test file to each at a time (about 10 minutes on 2 CPU cores); its 20 slowest tests at the end
	$(BIN)/python -m pytest -n 2 --dist loadscope --durations=20

test-slow:  ## the longer end-to-end checks
	$(BIN)/python -m pytest -m slow --durations=20

run:  ## the default experiment
	$(BIN)/python -m fsdp_exp

check-gpu:  ## does fsdp_exp work on this machine's GPUs? a few minutes of real runs, a pass/fail table
	$(BIN)/python -m fsdp_exp.check_gpu

gpu-session:  ## on a GPU machine, ten minutes: every GPU claim proven or disproven, one table and gpu_session.json (no install needed: docs/gpu.md)
	PYTHONPATH=$(CURDIR) $(PYTHON) -m fsdp_exp.gpu_session

bench:  ## every benchmark (about 40 minutes on 2 CPU cores); figures go in docs/BENCHMARKS.md
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/startup.py
	$(BIN)/python bench/checkpoint_stall.py
	$(BIN)/python bench/max_batch_search.py
	$(BIN)/python bench/memory_theory.py

bench-estimate:  ## task=estimate against measured CPU peaks, and the FSDP blog's table predicted (about 2 hours on 2 CPU cores)
	$(BIN)/python bench/estimate_accuracy.py
	$(BIN)/python bench/fsdp_blog_table.py

bench-gpu:  ## GPT throughput and MFU, and the FSDP blog's max-batch table, on one GPU
	$(BIN)/python bench/gpu.py

clean:
	rm -rf outputs/* .pytest_cache
