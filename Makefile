# One project-local virtual environment, rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test test-fast test-lowest faults lint bench clean gpu-wheels gpu-check

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

# Unit tests only, in one process each (the markers are declared in pyproject.toml), spread over
# FAST_WORKERS pytest-xdist workers (2: the smallest machine the suite runs on has two cores).
FAST_MARKERS := not slow and not server and not multiprocess and not subprocess
FAST_WORKERS ?= 2
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(FAST_WORKERS) tests -m "$(FAST_MARKERS)"

# The lower bounds of pyproject.toml's ranges, installed exactly (constraints/lowest.txt; the suite's
# tests/test_dependency_bounds.py keeps the two equal) into a venv of their own, and a test subset
# run there: models and HF conversion, tokenizers and prompt data sets, the RL maths, the critic
# service in process, generation; unit tests only (FAST_MARKERS), a few minutes. Rebuilt only when
# pyproject.toml or the constraints change.
# CI runs it after `make test`.
LOWEST_VENV ?= .venv-lowest
LOWEST_STAMP := $(LOWEST_VENV)/.installed
LOWEST_TESTS ?= tests/test_dependency_bounds.py tests/models/test_models.py tests/models/test_hf_convert.py \
	tests/models/test_hf_convert_files.py tests/models/test_hf_convert_errors.py tests/rl/test_rl_*.py \
	tests/test_checkpoint.py tests/test_tokenizers_tasks.py tests/test_cpu_compat.py \
	tests/actor/test_prompt_data.py tests/critic/test_critic_service*.py tests/generation/test_generation.py

define LOWEST_CHECK
import importlib.metadata as m, re
pins = dict(l.split("==") for l in (re.sub("#.*", "", l).strip() for l in open("constraints/lowest.txt")) if l)
got = {n: m.version(n).split("+")[0] for n in pins}
print("lowest:", " ".join(f"{n}=={v}" for n, v in got.items()))
bad = {n: v for n, v in got.items() if v != pins[n]}
assert not bad, f"installed {bad}, constraints/lowest.txt pins {pins}"
endef
export LOWEST_CHECK

# torch.compile'd decoding (2+ minutes here) depends on torch alone, which is the same release in
# `make test`: left to it.
LOWEST_DESELECT ?= not compiled

$(LOWEST_STAMP): pyproject.toml constraints/lowest.txt
	@test -x $(LOWEST_VENV)/bin/python || $(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	# torch first, exactly pinned, so nothing later resolves a CUDA build
	$(LOWEST_VENV)/bin/python -m pip install --quiet "torch==2.13.0"
	$(LOWEST_VENV)/bin/python -m pip install --quiet -c constraints/lowest.txt -e ".[dev]"
	@touch $(LOWEST_STAMP)

test-lowest: $(LOWEST_STAMP)
	@# what the venv holds is the constraints' versions, not newer ones
	$(LOWEST_VENV)/bin/python -c "$$LOWEST_CHECK"
	$(LOWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "$(FAST_MARKERS)" -k "$(LOWEST_DESELECT)" --durations=5 $(LOWEST_TESTS)

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
	rm -rf $(VENV) $(LOWEST_VENV) .pytest_cache runs

# The wheels a lent GPU machine lacks (it has torch, transformers, numpy, pyarrow, ..., and no network),
# as CPython 3.12 manylinux wheels in $(GPU_WHEELS) (ignored); docs/gpu-check.md. datasets, dill and
# multiprocess read the prompt file; antlr4 4.9.3 (hydra's parser) has no wheel on the index, so it is
# built here (pure Python). What travels there, this tree and the wheels together, must stay under 64 MiB.
GPU_WHEELS ?= .whl
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEEL_PINS ?= megatron-core==0.16.1 hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 \
	multiprocess==0.70.19
GPU_TRAVEL_MIB := 64
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -d $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	$(PYTHON) -m pip wheel --quiet --no-deps -w $(GPU_WHEELS) antlr4-python3-runtime==4.9.3
	@ls -1s --block-size=K $(GPU_WHEELS)/*.whl
	@wheels=$$(cat $(GPU_WHEELS)/*.whl | wc -c); \
	  tree=$$(git ls-files -z -co --exclude-standard | xargs -0 cat 2>/dev/null | wc -c); \
	  echo "wheels $$((wheels / 1024)) KiB + working tree $$((tree / 1024)) KiB = $$(((wheels + tree) / 1024)) KiB" \
	    "(at most $(GPU_TRAVEL_MIB) MiB travel)"; \
	  test $$((wheels + tree)) -le $$(($(GPU_TRAVEL_MIB) * 1048576)) || { echo "over $(GPU_TRAVEL_MIB) MiB"; exit 1; }

# The GPU check (docs/gpu-check.md): environment, pytest -m gpu, a short PPO run; one JSON report in
# runs/gpu_check.json. On the GPU machine (no .venv there) it installs $(GPU_WHEELS)/*.whl into $(GPU_SITE)
# when megatron-core, hydra or datasets cannot be imported; without CUDA it runs the reduced check.
# Options of the check: make gpu-check GPU_CHECK_ARGS="--steps 10 --recompute".
GPU_SITE ?= /tmp/site
GPU_CHECK_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK_ARGS ?=
gpu-check:
	@set -e; export PYTHONPATH="$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}"; \
	if ! $(GPU_CHECK_PY) -c "import megatron.core, hydra, omegaconf, datasets" 2>/dev/null; then \
	  ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1 || { echo "no wheels in $(GPU_WHEELS): run make gpu-wheels where pip has the index"; exit 1; }; \
	  echo "installing $(GPU_WHEELS)/*.whl into $(GPU_SITE)"; \
	  $(GPU_CHECK_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	    --target $(GPU_SITE) $(GPU_WHEELS)/*.whl; \
	fi; \
	$(GPU_CHECK_PY) -m aligner.gpu_check $(GPU_CHECK_ARGS)

# Install into throwaway venvs on the other supported Pythons and run a test subset there.
# Not part of `make test` (CI runs 3.11 only; on 3.10 pip picks transformers 5.20.x, the newest
# for it). The local CPU torch wheel is for 3.11 only, so
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
