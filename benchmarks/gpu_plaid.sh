#!/usr/bin/env bash
# PLAID on a GPU machine, from the repository root with OUT set to an empty folder:
#   OUT=/some/dir bash benchmarks/gpu_plaid.sh
# 1. builds the fast-plaid fixture with fast-plaid itself (wheels in .plaidwhl/; it pins
#    torch 2.11, the machine's own) into $OUT and copies it to tests/fixtures/plaid/;
# 2. installs lik (.whl/lik-*.whl, built with `pip wheel --no-deps -w .whl .`) and the
#    peers (.peers/) and runs tests/test_plaid.py, GPU tests and fixture checks included;
# 3. runs benchmarks/bench_plaid.py (with its launch-config sweep) into $OUT.
# Everything lands in $OUT: plaid_session.log, fast_plaid_nbits{2,4,8}.pt,
# plaid/<card>.json/.md/.png. A failing step is logged and the next one still runs.
set -uo pipefail

: "${OUT:?set OUT to the folder that collects logs and results}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/plaid_session.log") 2>&1

echo "== fast-plaid fixture"
wheels=$(ls .plaidwhl/*.whl)
# Keep the machine's numpy when it has one (torch was built against it).
python3 -c "import numpy" 2>/dev/null && wheels=$(ls .plaidwhl/*.whl | grep -v '/numpy-')
python3 -m pip install -q --no-index --no-deps --target /tmp/plaid $wheels ||
    echo "!! fast-plaid did not install"
PYTHONPATH=/tmp/plaid timeout -k 10 300 python3 -P tests/fixtures/plaid/make_fixture.py "$OUT"
echo "make_fixture exit code $?"
cp "$OUT"/fast_plaid_nbits*.pt tests/fixtures/plaid/ || echo "!! no fixture to test against"

echo "== install lik and peers"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/peers \
    .whl/lik-*.whl .peers/*.whl || echo "!! lik or peer wheels did not install"
export PYTHONPATH=/tmp/peers
nvidia-smi -L

echo "== tests/test_plaid.py"
timeout -k 10 "${TEST_TIMEOUT:-300}" python3 -P -m pytest -q -p no:cacheprovider -rs tests/test_plaid.py
echo "pytest exit code $?"

echo "== bench_plaid"
timeout -k 10 "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench_plaid.py --out "$OUT" --sweep ${BENCH_ARGS:---quick}
echo "bench_plaid exit code $?"
ls -la "$OUT"
