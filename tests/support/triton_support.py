"""Shared by the Triton kernel tests: interpreter/device selection and NaN-filled allocations."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_device = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs the Triton interpreter or CUDA"
)
gpu_only = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA device")


@contextlib.contextmanager
def nan_allocations():
    """torch.empty / empty_like return NaN-filled floating tensors: unwritten elements become visible."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **k: fill(empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like
