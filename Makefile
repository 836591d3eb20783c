# One project-local virtual environment, rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test test-fast faults lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, exactly pinned, so nothing later resolves a CUDA build
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Everything: unit tests, real servers, process groups, entry points, end-to-end learning runs.
# The flood of malformed requests lasts 20 s here (`make faults` floods for 60).
test: $(STAMP)
	ALIGNER_FAULTS_LOAD_S=$${ALIGNER_FAULTS_LOAD_S:-20} $(PY) -m pytest -q tests

# Unit tests only, in one process each (the markers are declared in pyproject.toml).
FAST_MARKERS := not slow and not server and not multiprocess and not subprocess
test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "$(FAST_MARKERS)"

# The fault suite alone: servers and actors killed at named points, a hung server, a full disk, 8
# clients flooding a server (ALIGNER_FAULTS_LOAD_S seconds, 60 by default); also part of `make test` (20 s there).
faults: $(STAMP)
	$(PY) -m pytest -q tests -m faults

lint: $(STAMP)
	$(VENV)/bin/ruff check aligner servers examples tests benchmarks
	$(VENV)/bin/ruff format --check aligner servers examples tests benchmarks

# The bench extra (trl and its dependencies) only for `make bench`: `make test` never needs it.
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache runs

# Install into throwaway venvs on the other supported Pythons and run a test subset there.
# Not part of `make test` (CI runs 3.11 only). The local CPU torch wheel is for 3.11 only, so
# elsewhere torch==2.13.0 may resolve to a CUDA build (several GB per venv): remove
# $(CHECK_VENVS) afterwards. Set CHECK_PYTHONS to interpreter paths if they are not on PATH.
CHECK_PYTHONS ?= python3.10 python3.12
CHECK_VENVS ?= /tmp/aligner-check-pythons
CHECK_TESTS ?= tests/models/test_models.py tests/models/test_hf_convert.py \
	tests/models/test_hf_convert_files.py tests/models/test_hf_convert_errors.py tests/rl/test_rl_*.py \
	tests/test_checkpoint.py tests/test_tokenizers_tasks.py tests/test_cpu_compat.py \
	tests/test_precision.py tests/critic/test_critic_service*.py tests/generation/test_generation.py

.PHONY: check-pythons
check-pythons:
	@set -e; for py in $(CHECK_PYTHONS); do \
	  tag=$$($$py -c 'import sys; print("py%d%d" % sys.version_info[:2])'); \
	  v=$(CHECK_VENVS)/$$tag; echo "== $$py ($$tag) in $$v"; \
	  test -x $$v/bin/python || $$py -m venv $$v; \
	  $$v/bin/python -m pip install --quiet --upgrade pip; \
	  $$v/bin/python -m pip install --quiet "torch==2.13.0"; \
	  $$v/bin/python -m pip install --quiet -e ".[dev]"; \
	  $$v/bin/python -m pytest -q -p no:cacheprovider $(CHECK_TESTS); \
	done
