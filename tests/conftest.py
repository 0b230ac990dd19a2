"""Test setup. Without a GPU, generated Triton kernels run under the interpreter: the
variable must be set before triton is first imported, hence here."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Keys without a committed entry launch the default config here instead of sweeping on
# their first call (hundreds of variants would each sweep, and write ~/.cache/lik);
# tests/test_autotune.py turns the sweep back on.
os.environ.setdefault("LIK_AUTOTUNE", "0")
# The suite's random tokens are unnormalized on purpose: no "look unnormalized" warning
# (tests/test_norm_warning.py turns it back on).
os.environ.setdefault("LIK_SUPPRESS_NORM_WARN", "1")


@pytest.fixture(params=["cpu", "interpreter"])
def lik_path(request, monkeypatch):
    """Which lik path a CPU call takes: the CPU backend (maxsim; the reference for the other
    entries), or the kernels under the interpreter."""
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    elif torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU (above)")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from lik.runtime import backends

    if backends.device_backend(torch.device("cpu")) != request.param:
        pytest.skip(f"no {request.param} path here")
    return request.param
