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


def attention_inputs(B, L, H, dk, dv, seed, dtype=torch.float32, device=DEVICE):
    """q, k [B, L, H, dk], v and a random cotangent do [B, L, H, dv], drawn in float64 from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, L, H, dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, L, H, dv, generator=g, dtype=torch.float64)
    do = torch.randn(B, L, H, dv, generator=g, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v, do))


def attention_padding(B, L, C, seed, device=DEVICE):
    """A key padding mask [B, L], True = pad. Batch 0: the whole second chunk (if any) plus random holes;
    batch 1: the first key of every chunk (so causal row 0 of each chunk sees nothing) plus random holes."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) < 0.25
    mask[0, C : 2 * C] = True
    mask[1, ::C] = True
    return mask.to(device)


OPCHECK = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck_cema_ops(fwd_op, bwd_op, bidirectional: bool, chunk: int) -> None:
    """torch.library.opcheck of a CEMA engine's forward and backward custom ops (the scan's ``cema_fwd`` /
    ``cema_bwd`` or the tensor-core form's, which share their signatures) on small random inputs."""
    B, L, D, N = 2, 9, 3, 2
    g = torch.Generator().manual_seed(0)
    rows = 2 * D if bidirectional else D
    x = torch.randn(B, L, D, generator=g).to(DEVICE)
    p, qr, qi, gr, gi = (0.5 * torch.rand(rows, N, generator=g).to(DEVICE) for _ in range(5))
    omega = torch.randn(D, generator=g).to(DEVICE)
    h0 = (
        (None, None)
        if bidirectional
        else tuple(torch.randn(B, D, N, generator=g).to(DEVICE) for _ in range(2))
    )
    pad = (torch.rand(B, L, generator=g) < 0.3).to(torch.int8).to(DEVICE)
    fwd_args = (x, p, qr, qi, gr, gi, omega, *h0, pad, bidirectional, chunk)
    torch.library.opcheck(fwd_op.default, fwd_args, test_utils=OPCHECK)
    y, h_re, h_im, saved_a, saved_b = fwd_op(*fwd_args)
    gh = (None, None) if bidirectional else (torch.randn_like(h_re), torch.randn_like(h_im))
    bwd_args = (
        torch.randn_like(y), *gh, x, p, qr, qi, gr, gi, omega, pad, saved_a, saved_b, bidirectional,
        not bidirectional, chunk,
    )  # fmt: skip
    torch.library.opcheck(bwd_op.default, bwd_args, test_utils=OPCHECK)
