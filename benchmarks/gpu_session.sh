#!/usr/bin/env bash
# One GPU session, run from the repository root with OUT set to an empty folder:
#   OUT=/some/dir bash benchmarks/gpu_session.sh
# Installs lik and the peer wheels (no network needed), records the environment, runs
# the GPU tests, then the forward and training benchmarks. Everything lands in $OUT:
# session.log, and each suite's <suite>/<card>.json/.md/.png, the layout of
# benchmarks/results (copy them over to commit: cp -r "$OUT"/*/ benchmarks/results/).
# Results record the commit git reads in this tree (with +dirty for local changes): run
# it on a copy that carries .git.
# Optional: TEST_TARGETS (default "-m gpu tests"), TEST_ARGS (e.g. "-n 14"),
# BENCH_ARGS / TRAIN_ARGS (extra flags, e.g. "--quick --shapes longdoc"), SKIP_FORWARD,
# SKIP_TRAIN, RUN_TUNE (sweep configs first and use them), RUN_RAGGED / RUN_RETRIEVE /
# RUN_BACKWARD / RUN_VARIANTS / RUN_FP8 / RUN_PLAID / RUN_HEAD / RUN_COLD_START / RUN_AUTOTUNE / RUN_HOST
# / RUN_PYLATE (needs pylate: benchmarks/gpu_integrations.sh installs it and runs it)
# (bench_<name>.py; bench_autotune takes about 8 minutes on an H200: raise EXTRA_TIMEOUT),
# RUN_GRID (the shape-class grids, bench_<suite>.py --grid for each of GRID_SUITES:
# "forward train" unless set, "fp8" and "retrieve" too; with GRID_ARGS, e.g. "--axes
# mask,ragged"), SKIP_TESTS,
# TEST_TIMEOUT / BENCH_TIMEOUT / TRAIN_TIMEOUT / EXTRA_TIMEOUT / GRID_TIMEOUT (seconds),
# PEERS_DIR.
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
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$PEERS_DIR" \
            .whl/lik-*.whl || echo "!! lik wheel did not install"
    else
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . ||
            echo "!! lik did not install; the benchmark records it as an error"
    fi
    echo "== install peers into $PEERS_DIR"
    if compgen -G ".peers/*.whl" >/dev/null; then
        ls -1 .peers/*.whl
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$PEERS_DIR" \
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
# One log for the whole run, next to the result files.
exec > >(tee "$OUT/session.log") 2>&1
setup

if [ -n "${RUN_TUNE:-}" ]; then
    echo "== tune (writes \$OUT/<family>.toml, then the installed runtime uses it)"
    timeout -k 10 "${TUNE_TIMEOUT:-240}" python3 -P benchmarks/tune.py --out "$OUT" --quick 2>&1
    echo "tune exit code $?"
    tables=$(python3 -P -c 'import lik.runtime, os; print(os.path.dirname(lik.runtime.__file__))')/tuning
    cp "$OUT"/*.toml "$tables"/ && echo "installed $(ls "$OUT"/*.toml) into $tables"
fi

if [ -z "${SKIP_TESTS:-}" ]; then
echo "== gpu tests (timeout ${TEST_TIMEOUT}s)"
timeout -k 10 "$TEST_TIMEOUT" python3 -P -m pytest -q -p no:cacheprovider ${TEST_ARGS:-} ${TEST_TARGETS:--m gpu tests} 2>&1
echo "pytest exit code $? (5 = no tests collected, 124 = timed out)"
fi

if [ -z "${SKIP_FORWARD:-}" ]; then
echo "== forward benchmark (timeout ${BENCH_TIMEOUT}s)"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout -k 10 "$BENCH_TIMEOUT" python3 benchmarks/bench_forward.py --out "$OUT" ${BENCH_ARGS:-} 2>&1
echo "bench_forward exit code $? (124 = timed out; results so far are kept)"

fi

if [ -z "${SKIP_TRAIN:-}" ]; then
echo "== training benchmark"
timeout -k 10 "${TRAIN_TIMEOUT:-300}" python3 benchmarks/bench_train.py --out "$OUT" ${TRAIN_ARGS:-} 2>&1
echo "bench_train exit code $?"
fi

if [ -n "${RUN_GRID:-}" ]; then
    for suite in ${GRID_SUITES:-forward train}; do
        echo "== $suite grid (timeout ${GRID_TIMEOUT:-480}s)"
        # shellcheck disable=SC2086  # GRID_ARGS is a list of flags
        timeout -k 10 "${GRID_TIMEOUT:-480}" python3 "benchmarks/bench_$suite.py" --grid --out "$OUT" ${GRID_ARGS:-} 2>&1
        echo "bench_$suite --grid exit code $? (124 = timed out; the cells measured so far are kept)"
    done
fi

for extra in backward ragged retrieve variants fp8 plaid head cold_start autotune host pylate; do
    flag="RUN_$(echo "$extra" | tr a-z A-Z)"
    if [ -n "${!flag:-}" ]; then
        echo "== $extra benchmark"
        timeout -k 10 "${EXTRA_TIMEOUT:-200}" python3 "benchmarks/bench_$extra.py" --out "$OUT" 2>&1
        echo "bench_$extra exit code $?"
    fi
done

ls -la "$OUT"
