#!/usr/bin/env bash
# One GPU session, run from the repository root with OUT set to an empty folder:
#   OUT=/some/dir bash benchmarks/gpu_session.sh
# Installs lik and the peer wheels (no network needed), records the environment, runs
# the GPU tests, then the forward benchmark. Everything lands flat in $OUT (6 files):
#   setup.log  gpu_tests.log  bench_forward.log  forward_<GPU>.json/.md/.png
# Optional: BENCH_ARGS (extra bench_forward.py flags, e.g. "--quick --shapes longdoc"),
# TEST_TIMEOUT and BENCH_TIMEOUT (seconds), PEERS_DIR (where the wheels install).
# A failing step is logged and the next one still runs.
set -uo pipefail

: "${OUT:?set OUT to the folder that collects logs and results}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"

PEERS_DIR="${PEERS_DIR:-/tmp/peers}"
TEST_TIMEOUT="${TEST_TIMEOUT:-150}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-420}"
export PYTHONUNBUFFERED=1

setup() {
    echo "== install lik"
    # A wheel built beforehand (pip wheel --no-deps -w .whl .) needs no build backend
    # on this machine; without one, fall back to an editable install.
    if compgen -G ".whl/lik-*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$PEERS_DIR" \
            .whl/lik-*.whl || echo "!! lik wheel did not install"
    else
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . ||
            echo "!! lik did not install; the benchmark records it as an error"
    fi
    echo "== install peers into $PEERS_DIR"
    if compgen -G ".peers/*.whl" >/dev/null; then
        ls -1 .peers/*.whl
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$PEERS_DIR" \
            .peers/*.whl || echo "!! peer wheels did not install"
    else
        echo "!! no wheels in .peers/: peers will be recorded as missing"
    fi
    echo "== environment"
    nvidia-smi -L
    python3 -P - <<'EOF'
import platform

import torch
import triton

print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("triton", triton.__version__)
print("devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for name in ("lik", "late_interaction_kernels", "flash_maxsim"):
    try:
        module = __import__(name)
        print(name, "importable from", module.__file__)
    except Exception as exc:
        print(name, "NOT importable:", type(exc).__name__, exc)
EOF
}

export PYTHONPATH="$PEERS_DIR${PYTHONPATH:+:$PYTHONPATH}"
setup 2>&1 | tee "$OUT/setup.log"

echo "== gpu tests (timeout ${TEST_TIMEOUT}s)"
timeout -k 10 "$TEST_TIMEOUT" python3 -P -m pytest -q -p no:cacheprovider ${TEST_ARGS:-} ${TEST_TARGETS:--m gpu tests} 2>&1 | tee "$OUT/gpu_tests.log"
echo "pytest exit code ${PIPESTATUS[0]} (5 = no tests collected, 124 = timed out)" |
    tee -a "$OUT/gpu_tests.log"

if [ -z "${SKIP_FORWARD:-}" ]; then
echo "== forward benchmark (timeout ${BENCH_TIMEOUT}s)"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout -k 10 "$BENCH_TIMEOUT" python3 benchmarks/bench_forward.py --out "$OUT" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench_forward.log"
echo "bench_forward exit code ${PIPESTATUS[0]} (124 = timed out; results so far are kept)" |
    tee -a "$OUT/bench_forward.log"

fi

if [ -z "${SKIP_TRAIN:-}" ]; then
echo "== training benchmark"
timeout -k 10 "${TRAIN_TIMEOUT:-300}" python3 benchmarks/bench_train.py --out "$OUT" ${TRAIN_ARGS:-} \
    2>&1 | tee "$OUT/bench_train.log"
echo "bench_train exit code ${PIPESTATUS[0]}" | tee -a "$OUT/bench_train.log"
fi

ls -la "$OUT"
