"""Test setup. Without a GPU, generated Triton kernels run under the interpreter: the
variable must be set before triton is first imported, hence here."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
