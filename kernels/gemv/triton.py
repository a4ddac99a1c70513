"""Triton kernel of the one-row GEMV y = W · round(x) + b + a (``kernels.gemv``).

``_row_gemv_kernel``: program p owns rows [p·BLOCK_O, (p+1)·BLOCK_O) of W [O, I] (row-major, any row stride).
It loops over the input width in tiles of BLOCK_I columns, loading a [BLOCK_O, BLOCK_I] tile of W (streamed:
``evict_first``, every weight is read exactly once per call) and the matching slice of x (float32, rounded
to W's dtype as a bf16 GEMV reads it, then widened), and accumulates the products elementwise in a float32
[BLOCK_O, BLOCK_I] register tile; one reduction over the columns at the end, then the bias and the addend,
and a float32 store. No atomics: each output is written by one program.

The block sizes are autotuned per (O, I) on a GPU (a bandwidth-bound kernel wants enough rows in flight per
SM and wide loads: tiles of 1-16 rows by 256-2048 columns). Under the interpreter (``TRITON_INTERPRET=1``,
CPU tensors, float16 / float32 weights) one small configuration runs.

``mega_suite::row_gemv`` (``torch.library.custom_op`` with a fake implementation) wraps the launcher so
that ``torch.compile`` keeps the kernel one opaque call inside a compiled decode step.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["fixed_config", "row_gemv", "row_gemv_op"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _row_gemv_kernel(
    w_ptr, x_ptr, b_ptr, a_ptr, y_ptr, O, I, stride_w,
    HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    row_ok = rows < O
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.float32)
    for start in range(0, I, BLOCK_I):
        cols = start + tl.arange(0, BLOCK_I)
        col_ok = cols < I
        w = tl.load(
            w_rows + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
        x = x.to(w_ptr.dtype.element_ty).to(tl.float32)  # round(x): the activation as the weight dtype
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0)
    if HAS_ADD:
        y += tl.load(a_ptr + rows, mask=row_ok, other=0.0)
    tl.store(y_ptr + rows, y, mask=row_ok)


def _configs() -> list[triton.Config]:
    if INTERPRET:  # one configuration: the autotuner then runs it without benchmarking
        return [triton.Config(dict(BLOCK_O=4, BLOCK_I=16), num_warps=4, num_stages=1)]
    # (rows, columns, warps): an fp32 accumulator of rows x columns / (32 x warps) registers per thread
    # (at most 64 here); 8-16 bf16 columns per thread per load.
    tiles = [(1, 2048, 8), (1, 4096, 8), (2, 1024, 4), (2, 2048, 8), (2, 4096, 8), (4, 512, 4), (4, 1024, 4),
             (4, 1024, 8), (4, 2048, 8), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8)]  # fmt: skip
    return [triton.Config(dict(BLOCK_O=o, BLOCK_I=i), num_warps=w, num_stages=2) for o, i, w in tiles]


def _prune(configs, named_args, **kwargs):
    """Drop column tiles wider than the input (one tile covers it) and keep one of each remaining shape."""
    width = triton.next_power_of_2(int({**named_args, **kwargs}["I"]))
    seen, kept = set(), []
    for cfg in configs:
        meta = dict(cfg.kwargs, BLOCK_I=min(cfg.kwargs["BLOCK_I"], max(width, 16)))
        key = (tuple(sorted(meta.items())), cfg.num_warps, cfg.num_stages)
        if key not in seen:
            seen.add(key)
            kept.append(triton.Config(meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return kept


_row_gemv_tuned = triton.autotune(
    _configs(), key=["O", "I"], prune_configs_by={"early_config_prune": _prune}
)(_row_gemv_kernel)


_FIXED: dict | None = None


@contextlib.contextmanager
def fixed_config(block_o: int = 4, block_i: int = 512, num_warps: int = 4):
    """Launch with these block sizes inside the ``with`` block instead of the autotuned ones (the default is
    one of the autotune configurations, which tests/kernels/test_triton_compile.py compiles for sm_80 / sm_90)."""
    global _FIXED
    previous, _FIXED = _FIXED, dict(BLOCK_O=block_o, BLOCK_I=block_i, num_warps=num_warps, num_stages=2)
    try:
        yield
    finally:
        _FIXED = previous


def row_gemv(w: Tensor, x: Tensor, bias: Tensor | None = None, add: Tensor | None = None) -> Tensor:
    """w [O, I] (unit column stride) float16 / bfloat16 / float32, x [I] float32, bias / add [O] float32 or
    None -> y [O] float32 = W · round(x) + bias + add (``kernels.gemv``)."""
    if w.dim() != 2 or x.shape != (w.shape[1],) or w.stride(1) != 1:
        raise ValueError(f"row_gemv needs w [O, I] with unit column stride and x [I]; got {tuple(w.shape)}, "
                         f"stride {w.stride()}, x {tuple(x.shape)}")  # fmt: skip
    if w.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"row_gemv: w must be float16, bfloat16 or float32, got {w.dtype}")
    o, i = w.shape
    for name, t, shape in (("x", x, (i,)), ("bias", bias, (o,)), ("add", add, (o,))):
        if t is not None and (t.dtype != torch.float32 or t.shape != shape or t.device != w.device):
            raise ValueError(
                f"row_gemv: {name} must be float32 {list(shape)} on {w.device}, got {t.dtype} "
                f"{list(t.shape)} on {t.device}"
            )
    y = torch.empty(o, dtype=torch.float32, device=w.device)
    x, bias, add = (
        x.contiguous(),
        None if bias is None else bias.contiguous(),
        None if add is None else add.contiguous(),
    )

    def grid(meta):
        return (triton.cdiv(o, meta["BLOCK_O"]),)

    args = (w, x, y if bias is None else bias, y if add is None else add, y, o, i, w.stride(0))
    meta = dict(HAS_BIAS=bias is not None, HAS_ADD=add is not None)
    if _FIXED is None:
        _row_gemv_tuned[grid](*args, **meta)
    else:
        _row_gemv_kernel[grid](*args, **meta, **_FIXED)
    return y


@torch.library.custom_op("mega_suite::row_gemv", mutates_args=())
def row_gemv_op(w: Tensor, x: Tensor, bias: Tensor | None, add: Tensor | None) -> Tensor:
    return row_gemv(w, x, bias, add)


@row_gemv_op.register_fake
def _(w, x, bias, add):
    return x.new_empty(w.shape[0], dtype=torch.float32)
