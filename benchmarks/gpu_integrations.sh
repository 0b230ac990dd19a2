#!/usr/bin/env bash
# The integrations' GPU tests and the PyLate benchmark, run from the repository root with
# OUT set to a folder:
#   OUT=/some/dir bash benchmarks/gpu_integrations.sh
# Needs no network: installs the lik wheel (.whl/), the carried wheels (.intwhl/: pylate,
# colpali-engine and what their imports need beyond the machine's own packages) and, where
# present, the peer wheels (.peers/: late-interaction-kernels, flash-maxsim, for PyLate's
# "lik" and "flash" backends) into SITE_DIR, then runs tests/test_integration_gpu.py and
# benchmarks/bench_pylate.py. Writes $OUT/integrations_gpu.log and $OUT/pylate/<card>.*.
# Optional: SITE_DIR (default /tmp/site), TEST_TIMEOUT (seconds, default 300),
# BENCH_TIMEOUT (default 420), BENCH_ARGS (e.g. "--quick"), SKIP_BENCH.
set -uo pipefail

: "${OUT:?set OUT to the folder that collects the log}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
LOG="$OUT/integrations_gpu.log"
SITE_DIR="${SITE_DIR:-/tmp/site}"
TEST_TIMEOUT="${TEST_TIMEOUT:-300}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-420}"
export PYTHONUNBUFFERED=1

{
    echo "== install lik and the carried wheels into $SITE_DIR"
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE_DIR" \
        .whl/lik-*.whl || echo "!! lik wheel did not install"
    ls -1 .intwhl/*.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE_DIR" \
        .intwhl/*.whl || echo "!! carried wheels did not install"
    if compgen -G ".peers/*.whl" >/dev/null; then
        ls -1 .peers/*.whl
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE_DIR" \
            .peers/*.whl || echo "!! peer wheels did not install"
    else
        echo "!! no wheels in .peers/: PyLate's flash and lik backends will be recorded as missing"
    fi
} 2>&1 | tee "$LOG"

export PYTHONPATH="$SITE_DIR${PYTHONPATH:+:$PYTHONPATH}"

{
    echo "== environment"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    python3 -P - <<'PY'
import importlib
from importlib.metadata import PackageNotFoundError, version

for name in ("lik", "torch", "triton", "transformers", "sentence-transformers", "tokenizers",
             "huggingface-hub", "datasets", "pylate", "colpali-engine",
             "late-interaction-kernels", "flash-maxsim"):
    try:
        print(f"{name} {version(name)}")
    except PackageNotFoundError:
        print(f"{name} MISSING")
for module in ("pylate.scores", "pylate.losses", "colpali_engine.loss.late_interaction_losses",
               "colpali_engine.utils.processing_utils"):
    try:
        importlib.import_module(module)
        print(f"import {module}: ok")
    except Exception as error:  # the tests would only skip: say why here
        print(f"!! import {module}: {type(error).__name__}: {error}")
PY
    echo "== tests/test_integration_gpu.py"
    timeout "$TEST_TIMEOUT" python3 -P -m pytest -q -rs -p no:cacheprovider --durations=10 \
        -m gpu tests/test_integration_gpu.py
    echo "== pytest exit status $?"
} 2>&1 | tee -a "$LOG"

if [ -z "${SKIP_BENCH:-}" ]; then
    {
        echo "== benchmarks/bench_pylate.py"
        # shellcheck disable=SC2086  # BENCH_ARGS holds several flags
        timeout -k 10 "$BENCH_TIMEOUT" python3 -P benchmarks/bench_pylate.py --out "$OUT" \
            ${BENCH_ARGS:-}
        echo "== bench_pylate exit status $?"
    } 2>&1 | tee -a "$LOG"
fi
