# Targets that run project code on this machine (generate, check, lint, test, demo) set up
# the virtual environment first, so `make demo` and `make test` work on a fresh clone.
# GPU targets (bench, tune, test-gpu) use the GPU machine's own python3 and torch build.

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# pyproject only asks for torch>=2.4; installed alone, pip would pick a multi-GB CUDA
# build. Installing the CPU release first makes the project install keep it.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.lik-setup-done

.PHONY: setup generate check lint test demo bench tune test-gpu clean

setup: $(STAMP)

# Re-runs only when pyproject.toml changes (new dependencies); otherwise a no-op.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install $(TORCH)
	$(VPY) -m pip install -e '.[dev]'
	touch $@

generate: setup
	$(VPY) -m lik_gen generate

check: setup
	$(VPY) -m lik_gen check

lint: setup
	$(VPY) -m ruff check .

# The suite sets TRITON_INTERPRET itself where it runs kernels on the CPU.
test: setup
	$(VPY) -m pytest -q

demo: setup
	$(VPY) -m lik.demo

bench:
	python3 benchmarks/bench_forward.py --out benchmarks/results

# Not built yet: the sweep that writes runtime/tuning/<family>.toml comes with the
# performance work. Until then the tables hold heuristic defaults only.
tune:
	@echo 'make tune: no tuner yet; runtime/tuning/*.toml use lik.runtime.tuning.default_config' >&2; exit 1

# -P keeps the source tree's lik/ folder from shadowing the installed package.
test-gpu:
	python3 -P -m pytest -q -m gpu tests

# Leaves $(VENV) alone (reinstalling torch takes minutes); `rm -rf $(VENV)` for a full reset.
clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -exec rm -rf {} +
