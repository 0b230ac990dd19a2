#!/usr/bin/env bash
# Sharded retrieval on a machine with several GPUs, from the repository root with OUT set:
#   OUT=/some/dir bash benchmarks/gpu_sharded.sh
# Installs the lik wheel (.whl/), writes a random corpus, retrieves its top-k once in one
# process and once with torchrun over every GPU (NCCL, NVLink multicast off), and checks
# that scores and indices are identical. Writes $OUT/sharded.log.
set -uo pipefail
: "${OUT:?set OUT to the folder that collects the log}"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
SITE_DIR="${SITE_DIR:-/tmp/site}"
WORK=$(mktemp -d)
{
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE_DIR" \
        .whl/lik-*.whl
    export PYTHONPATH="$SITE_DIR"
    cd "$WORK"  # away from the checkout, whose lik/ folder would shadow the package
    gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    echo "== $gpus GPUs: $(nvidia-smi -L | tr '\n' ' ')"
    python3 -P - "$WORK" <<'PY'
import sys, torch
torch.manual_seed(0)
q = torch.nn.functional.normalize(torch.randn(16, 32, 128), dim=-1).bfloat16()
d = torch.nn.functional.normalize(torch.randn(50_003, 64, 128), dim=-1).bfloat16()
d[[10, 40_000]] = d[7].clone()  # exact ties that straddle shards
torch.save(q, f"{sys.argv[1]}/q.pt")
torch.save(d, f"{sys.argv[1]}/d.pt")
PY
    args=(retrieve --queries "$WORK/q.pt" --corpus "$WORK/d.pt" --top-k 50 --chunk 65536 --show 0)
    python3 -P -m lik "${args[@]}" --device cuda --out "$WORK/single.pt"
    python3 -P -m torch.distributed.run --nproc-per-node="$gpus" -m lik "${args[@]}" \
        --out "$WORK/sharded.pt"
    python3 -P - "$WORK" <<'PY'
import sys, torch
a = torch.load(f"{sys.argv[1]}/single.pt")
b = torch.load(f"{sys.argv[1]}/sharded.pt")
same_ids = torch.equal(a["indices"].cpu(), b["indices"].cpu())
same_scores = torch.equal(a["scores"].cpu(), b["scores"].cpu())
print(f"sharded == single process: indices {same_ids}, scores {same_scores}")
sys.exit(0 if same_ids and same_scores else 1)
PY
    echo "== exit status $?"
} 2>&1 | tee "$OUT/sharded.log"
