# moeheal: `make heal` runs the bundled demo end to end, `make test` runs the tests.
# Both create .venv and install the project into it when missing (a no-op afterwards), at the versions
# requirements/lock.txt pins (`make lock` writes it; `make test-latest` tries the newest releases).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CONFIG ?= demo/heal.toml
OUT    ?= export
LOCK   := requirements/lock.txt
# torch is only for the parity tests (transformers loads our GGUFs): the CPU build, pinned here.
TORCH  := requirements/torch.txt
# `-P`: the working directory is not put on sys.path, where our `kernels/` would shadow Hugging
# Face's `kernels` (DESIGN.md, Imports).
PYTEST  = $(BIN)/python -P -m pytest

.PHONY: heal test test-fast test-slow test-gpu test-latest lock bench audit sql export report card clean setup setup-test

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(LOCK) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed $(TORCH)
	$(BIN)/python -m pip install -q -c $(LOCK) -r $(TORCH)
	$(BIN)/python -m pip install -q -c $(LOCK) -e '.[test,ray]'
	touch $@

# The lock: pip-compile resolves pyproject.toml with its test and ray extras (the heal's environment is the
# same lock's subset) and the torch pin. The CPU build's local label (+cpu) is dropped, so the pin
# also admits the same release where only PyPI's build is at hand.
lock:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q pip-tools
	$(BIN)/pip-compile -q --upgrade --extra test --extra ray --strip-extras --no-emit-index-url --no-emit-find-links \
		-c $(TORCH) -o $(LOCK) pyproject.toml
	sed -i 's/^torch==\([^+]*\)+cpu$$/torch==\1/' $(LOCK)

# The suite once against the newest releases of everything but torch, in a venv of its own: a release
# that breaks us shows here before a new lock takes it into CI.
test-latest:
	test -x .venv-latest/bin/python || $(PYTHON) -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q --upgrade pip
	.venv-latest/bin/python -m pip install -q -r $(TORCH)
	.venv-latest/bin/python -m pip install -q --upgrade --upgrade-strategy eager -c $(TORCH) -e '.[test,ray]'
	.venv-latest/bin/python -m pip list --format=freeze > .venv-latest/versions.txt
	.venv-latest/bin/python -P -m pytest -q -m "not gpu" -n 2 --dist loadfile --no-loadscope-reorder

# The per-layer units (quantize + calibrate per variant and layer, and the dumps and recipes they read)
# on HEAL_WORKERS processes at once (`moeheal heal --workers N`: N `--shard I/N` workers, every stage
# built once under its lock, the same bytes as one process; docs/scale-out.md), then the rest in one:
# one process leaves a second core idle much of the time. HEAL_WORKERS=1: a single process.
HEAL_WORKERS ?= 2
heal: setup
	$(BIN)/moeheal heal -c $(CONFIG) --workers $(HEAL_WORKERS)

# Two workers (pytest-xdist), each test file on one of them (`--dist loadfile`): module fixtures
# (the small healed worlds) are built once, and JAX's compilation cache (tests/conftest.py) is
# shared; the worlds' reports skip their plots (MOEHEAL_PLOTS=0). Files go out in collection order
# (`--no-loadscope-reorder`; tests/conftest.py puts the longest first): xdist's default sends the files
# with the most tests first, so the one-test heals ran last on one worker. The whole suite took 8 min 40 s
# to 9 min 54 s on a 2-core machine, cold cache, and 12 min 30 s on a day that machine ran a third
# slower (bench/RESULTS.md, Test suite, has each beside a reference pair). Tests marked `slow` are
# left to `make test-slow`.
test: setup-test
	$(PYTEST) -q -m "not gpu and not slow" -n 2 --dist loadfile --no-loadscope-reorder

# The tests marked `slow`, outside CI's time: the 200-round publishing stress test (tests/test_publish.py,
# minutes), what `moeheal init` writes healed on all six families (tests/test_families_init_heal.py; qwen3moe's is also healed in CI through the installed wheel, tests/test_wheel_init.py) and a learned quantize unit taking the accelerator's compile-ahead path (tests/test_learned.py).
test-slow: setup-test
	$(PYTEST) -q -m "slow and not gpu" -n 2 --dist loadfile --no-loadscope-reorder

# The edit-test loop: the formats (every registered one: bytes, scales, importance), importance,
# alpha/ridge, allocation, KLD, n-grams and MoCE kernels, the SQL statistics and audit, config, the
# DAG's cache on small stages, the corpus, the card's blocks and the bench scripts' figures: the test
# files whose tests take seconds of CPU each, on the same two workers as `make test`. The k-quant,
# i-quant and GPTQ numerics (test_kquants, test_iquants, test_gptq) take minutes.
FAST_TESTS ?= tests/test_formats.py tests/test_importance.py tests/test_alpha_ridge.py \
	tests/test_allocate.py tests/test_kld.py tests/test_ngram.py tests/test_moce.py tests/test_stats.py \
	tests/test_audit.py tests/test_config.py tests/test_corpus.py tests/test_dag.py tests/test_card.py \
	tests/test_bench_tools.py tests/test_imports.py
test-fast: setup-test
	$(PYTEST) -q -x -m "not gpu and not slow and not long and not llamacpp" -n 2 --dist loadfile --no-loadscope-reorder $(FAST_TESTS)

# The GPU against the CPU, on a machine with JAX for CUDA (`pip install -e '.[cuda]'`); the tests
# default JAX to the CPU, so the platforms are named here.
test-gpu: setup-test
	JAX_PLATFORMS=cuda,cpu $(PYTEST) -q -m gpu tests/test_gpu.py

# Every speed benchmark with its defaults (minutes each on a 2-core CPU), to the end; the exit status
# says whether any failed. bench/experiments/ and bench/tools/ are run by hand, as their docstrings show.
bench: setup-test
	@failed=""; for b in bench/speed/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || failed="$$failed $$b"; done; \
	if [ -n "$$failed" ]; then echo "failed:$$failed"; exit 1; fi

audit: setup
	$(BIN)/moeheal audit -c $(CONFIG)

report: setup
	$(BIN)/moeheal report -c $(CONFIG)

# Rewrite the measured numbers in demo/README.md, README.md's headline and bench/RESULTS.md (from
# CONFIG's lake, after `make heal`; the rows they come from go to demo/results/) and in
# demo/model/MODEL_CARD.md (from the model).
card: setup
	$(BIN)/python demo/card.py -c $(CONFIG)

# usage: make sql Q="SELECT * FROM comparisons"
sql: setup
	$(BIN)/moeheal sql -c $(CONFIG) "$(Q)"

export: setup
	$(BIN)/moeheal export -c $(CONFIG) --out $(OUT)

clean:
	find lake -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
