# Targets that run project code on this machine (generate, check, lint, test, demo) set up
# the virtual environment first, so `make demo` and `make test` work on a fresh clone.
# GPU targets (bench, tune, test-gpu) use the GPU machine's own python3 and torch build.

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# pyproject only asks for torch>=2.4; installed alone, pip would pick a multi-GB CUDA
# build. Installing a CPU release first makes the project install keep it (where pip's
# sources serve PyPI's CUDA build of this pin, add PyTorch's CPU --index-url to TORCH).
TORCH ?= torch==2.13.0
# Two stages, so each command installs what it needs: the demo (and generate, check,
# lint) needs torch, Triton for the interpreter and the generator's tools; the tests add
# pytest, hypothesis, build and the pinned integration libraries below.
STAMP := $(VENV)/.lik-setup-done
TEST_STAMP := $(VENV)/.lik-test-setup-done
INTEGRATIONS_STAMP := $(VENV)/.lik-integrations-done
# The libraries the integration tests compare against, and what their score and loss
# modules import, pinned. --no-deps: their own requirements pin torch builds (fast-plaid,
# torchvision) that would replace the CPU torch above.
INTEGRATIONS := pylate==1.6.0 colpali-engine==0.3.18 \
	transformers==5.3.0 sentence-transformers==5.3.0 huggingface-hub==1.33.0 \
	tokenizers==0.22.2 safetensors==0.8.0 regex==2026.11.19 pyyaml==6.0.4 tqdm==4.70.1 \
	packaging==26.4 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 idna==3.20 \
	certifi==2026.10.19.post1 datasets==5.2.0 pyarrow==26.0.1 pandas==3.1.1 \
	python-dateutil==4.0.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 \
	scipy==1.17.1 scikit-learn==1.9.1 joblib==1.6.0 threadpoolctl==3.8.0 \
	narwhals==2.29.0 cloudpickle==3.1.3 pillow==13.0.0

# Sentence Transformers 6 gets a folder of its own (pip --target, put first on PYTHONPATH
# for its tests): pylate 1.6 above pins sentence-transformers 5.3. --no-deps: ST 6.2.0
# needs transformers>=5,<6, tokenizers>=0.19, huggingface-hub>=1.3,<3, torch>=2.2,
# numpy>=1.24, scikit-learn>=1.1, scipy>=1.0, typing_extensions>=4.10 and tqdm, which the
# CPU torch and the pins above meet (transformers 5.3.0, huggingface-hub 1.33.0, ...).
ST6 := $(VENV)/st6
ST6_PIN := sentence-transformers==6.2.0
ST6_STAMP := $(ST6)/.lik-st6-done
# The clients' sdists (their test suites), downloaded at setup and checked against the
# sha256 pins in tests/clients/run_client_suites.py, so the test runs need no network.
CLIENT_SDISTS := $(VENV)/client-sdists
CLIENT_SDISTS_STAMP := $(CLIENT_SDISTS)/.lik-sdists-done

.PHONY: setup setup-demo setup-test setup-integrations setup-st6 generate check lint test \
	test-clients test-st6 demo bench bench-cpu soak tune test-gpu clean

# Everything: what the demo needs, then what the tests add.
setup: setup-demo setup-test

setup-demo: $(STAMP)

# Re-runs only when pyproject.toml changes (new dependencies); otherwise a no-op.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install $(TORCH)
	$(VPY) -m pip install -e '.[gen,triton]'
	touch $@

setup-test: $(TEST_STAMP) $(INTEGRATIONS_STAMP) $(ST6_STAMP) $(CLIENT_SDISTS_STAMP)

$(TEST_STAMP): $(STAMP)
	$(VPY) -m pip install -e '.[dev]'
	touch $@

setup-integrations: $(INTEGRATIONS_STAMP)

# Re-runs after the project install or when the pins above change.
$(INTEGRATIONS_STAMP): $(TEST_STAMP) Makefile
	$(VPY) -m pip install --no-deps $(INTEGRATIONS)
	touch $@

setup-st6: $(ST6_STAMP)

$(ST6_STAMP): $(TEST_STAMP) Makefile
	rm -rf $(ST6)
	$(VPY) -m pip install --no-deps --target $(ST6) $(ST6_PIN)
	touch $@

$(CLIENT_SDISTS_STAMP): $(TEST_STAMP) tests/clients/run_client_suites.py
	$(VPY) tests/clients/run_client_suites.py --cache $(CLIENT_SDISTS) --fetch-only
	touch $@

generate: setup-demo
	$(VPY) -m lik_gen generate

check: setup-demo
	$(VPY) -m lik_gen check

lint: setup-demo
	$(VPY) -m ruff check .

# The suite sets TRITON_INTERPRET itself where it runs kernels on the CPU. Before it: the
# clients' own suites, plain and with lik enabled (about 1.5 minutes), and the Sentence
# Transformers 6 tests in the ST 6 folder (about 1 minute); the suite's summary comes last.
test: setup-test test-clients test-st6
	LIK_ST6_PATH=$(abspath $(ST6)) $(VPY) -m pytest -q

test-clients: setup-test
	$(VPY) tests/clients/run_client_suites.py --cache $(CLIENT_SDISTS)

test-st6: setup-test
	PYTHONPATH=$(abspath $(ST6)) $(VPY) -m pytest -q tests/test_integration_sentence_transformers.py

demo: setup-demo
	$(VPY) -m lik.demo

# Every benchmark, one after the other, into the committed results folder: each writes
# benchmarks/results/<suite>/<card>.{json,md,png}, stamped with the card and the commit
# git reads (+dirty for local changes). benchmarks/README.md says what each measures.
BENCHES := forward train backward ragged retrieve variants fp8 plaid head cold_start autotune host pylate

bench:
	for name in $(BENCHES); do python3 benchmarks/bench_$$name.py --out benchmarks/results || exit 1; done

# The CPU backend against PyTorch's compositions and maxsim-cpu, on this machine's CPU
# (maxsim-cpu installs beside the test setup; the suite records it missing otherwise).
bench-cpu: setup-test
	$(VPY) -m pip install -q maxsim-cpu==0.1.0 matplotlib || true
	$(VPY) benchmarks/bench_cpu.py --out benchmarks/results

# Random public calls against the float64 reference on this GPU, SOAK_WORKERS processes
# for SOAK_SECONDS each (compiling dominates); writes benchmarks/results/soak/<card>.*.
# Then the suite's seeded fuzz (tests/test_fuzz.py: garbage in padding, non-finite valid
# values) on the GPU, SOAK_FUZZ_SCALE times its CI draws; it prints its case counts.
SOAK_SECONDS ?= 600
SOAK_WORKERS ?= 8
SOAK_FUZZ_SCALE ?= 10
soak:
	python3 benchmarks/soak.py --seconds $(SOAK_SECONDS) --workers $(SOAK_WORKERS)
	LIK_FUZZ_CASES=$(SOAK_FUZZ_SCALE) python3 -P -m pytest -q -s -p no:cacheprovider -m gpu \
		tests/test_fuzz.py -k cuda_path

# Sweeps launch configs for the benchmark shapes on this GPU and rewrites the committed
# table runtime/tuning/<family>.toml, or with TUNE_ARGS="--card --shapes ..." this card's
# own runtime/tuning/<family>/<card>.toml (commit the result).
tune:
	python3 -P benchmarks/tune.py --out runtime/tuning $(TUNE_ARGS)

# -P keeps the source tree's lik/ folder from shadowing the installed package.
test-gpu:
	python3 -P -m pytest -q -m gpu tests

# Leaves $(VENV) alone (reinstalling torch takes minutes); `rm -rf $(VENV)` for a full reset.
clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -exec rm -rf {} +
