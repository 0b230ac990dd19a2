"""The read-alone ceiling's kernels (benchmarks/read_ceiling.py) read every element: a
reader that skipped some would report a ceiling faster than any real read."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
read_ceiling = pytest.importorskip("read_ceiling")

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter check; on a GPU the benchmark runs it"
)


@pytest.mark.parametrize("evict_first", [False, True])
@pytest.mark.parametrize("n", [1, 4095, 4096 * 3 + 17])
def test_read_kernels_sum_every_element(n, evict_first):
    x = torch.rand(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    expected = x.double().sum().item()
    block = 4096
    partial = torch.zeros(8)
    read_ceiling._stream_sum[(3,)](x, partial, n, BLOCK=block, EVICT_FIRST=evict_first)
    assert partial.double().sum().item() == pytest.approx(expected, rel=1e-5)
    blocks = -(-n // block)
    partial = torch.zeros(blocks + 2)
    read_ceiling._block_sum[(blocks,)](x, partial, n, BLOCK=block, EVICT_FIRST=evict_first)
    assert partial[blocks:].abs().sum().item() == 0  # one partial per block, no more
    assert partial.double().sum().item() == pytest.approx(expected, rel=1e-5)
