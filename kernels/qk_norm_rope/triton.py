"""Q and K from Z in one Triton kernel forward and one backward (docs/architecture.md#normalised-attention).

A program owns ``BLOCK_R`` tokens of one head: it loads their Z rows as even and odd halves (the RoPE pairs),
normalises, scales, offsets and rotates them for both Q and K, and writes Q and K in the output dtype. The
backward recomputes the normalisation from Z (nothing else is stored), rotates dQ and dK back, and writes dZ
and per-program partial sums of dγ and dβ, which one reduction adds up. Everything runs in float32.
The PyTorch path did this in about fifty ops forward and again in the recompute.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _load_pairs(ptr, rows, cols, row_stride, mask):
    offs = rows[:, None] * row_stride + 2 * cols[None, :]
    even = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(ptr + offs + 1, mask=mask, other=0.0).to(tl.float32)
    return even, odd


@triton.jit
def _head_params(ptr, which, head, cols, H, ZD, col_mask):
    """Even and odd entries of row ``which`` (0: Q, 1: K) of a [2, H * ZD] parameter, for one head."""
    base = ptr + which * H * ZD + head * ZD + 2 * cols
    return (
        tl.load(base, mask=col_mask, other=0.0).to(tl.float32),
        tl.load(base + 1, mask=col_mask, other=0.0).to(tl.float32),
    )


@triton.jit
def _normalised(z0, z1, ZD, eps):
    rstd = tl.rsqrt((tl.sum(z0 * z0, 1) + tl.sum(z1 * z1, 1)) / ZD + eps)
    return z0 * rstd[:, None], z1 * rstd[:, None], rstd


@triton.jit
def _fwd_kernel(
    Z, G, BETA, INV, Q, K, rows_total, L, H, start, chunk, scale, eps,
    ZD: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid, head = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # tokens of the flattened [B * L]
    cols = tl.arange(0, HALF)
    col_mask = cols < ZD // 2
    mask = (rows < rows_total)[:, None] & col_mask[None, :]
    row_stride = H * ZD
    zptr = Z + head * ZD
    z0, z1 = _load_pairs(zptr, rows, cols, row_stride, mask)
    zh0, zh1, _ = _normalised(z0, z1, ZD, eps)
    pos = ((rows % L + start) % chunk).to(tl.float32)
    inv = tl.load(INV + cols, mask=col_mask, other=0.0)
    angle = pos[:, None] * inv[None, :]
    c, s = tl.cos(angle), tl.sin(angle)
    offs = rows[:, None] * row_stride + head * ZD + 2 * cols[None, :]
    for which in tl.static_range(2):
        g0, g1 = _head_params(G, which, head, cols, H, ZD, col_mask)
        b0, b1 = _head_params(BETA, which, head, cols, H, ZD, col_mask)
        a0 = zh0 * ((1 + g0) * scale)[None, :] + b0[None, :]
        a1 = zh1 * ((1 + g1) * scale)[None, :] + b1[None, :]
        out = Q if which == 0 else K
        tl.store(out + offs, (a0 * c - a1 * s).to(out.dtype.element_ty), mask=mask)
        tl.store(out + offs + 1, (a0 * s + a1 * c).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(
    Z, G, INV, DQ, DK, DZ, PG, PB, rows_total, L, H, start, chunk, scale, eps,
    ZD: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid, head = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HALF)
    col_mask = cols < ZD // 2
    mask = (rows < rows_total)[:, None] & col_mask[None, :]
    row_stride = H * ZD
    z0, z1 = _load_pairs(Z + head * ZD, rows, cols, row_stride, mask)
    zh0, zh1, rstd = _normalised(z0, z1, ZD, eps)
    pos = ((rows % L + start) % chunk).to(tl.float32)
    inv = tl.load(INV + cols, mask=col_mask, other=0.0)
    angle = pos[:, None] * inv[None, :]
    c, s = tl.cos(angle), tl.sin(angle)
    dzh0 = tl.zeros([BLOCK_R, HALF], dtype=tl.float32)
    dzh1 = tl.zeros([BLOCK_R, HALF], dtype=tl.float32)
    for which in tl.static_range(2):
        g0, g1 = _head_params(G, which, head, cols, H, ZD, col_mask)
        d0, d1 = _load_pairs((DQ if which == 0 else DK) + head * ZD, rows, cols, row_stride, mask)
        a0 = d0 * c + d1 * s  # the rotation's transpose: the gradient before RoPE
        a1 = d1 * c - d0 * s
        part = (pid * 2 + which) * H * ZD + head * ZD + 2 * cols  # partial sums [programs, 2, H * ZD]
        tl.store(PB + part, tl.sum(a0, 0), mask=col_mask)
        tl.store(PB + part + 1, tl.sum(a1, 0), mask=col_mask)
        tl.store(PG + part, tl.sum(a0 * zh0, 0) * scale, mask=col_mask)
        tl.store(PG + part + 1, tl.sum(a1 * zh1, 0) * scale, mask=col_mask)
        dzh0 += a0 * ((1 + g0) * scale)[None, :]
        dzh1 += a1 * ((1 + g1) * scale)[None, :]
    # d(x r)/dx: r (dy - ẑ mean(dy ẑ)) for ẑ = x r, r = 1 / sqrt(mean(x²) + eps)
    dot = (tl.sum(dzh0 * zh0, 1) + tl.sum(dzh1 * zh1, 1)) / ZD
    dz0 = rstd[:, None] * (dzh0 - zh0 * dot[:, None])
    dz1 = rstd[:, None] * (dzh1 - zh1 * dot[:, None])
    offs = rows[:, None] * row_stride + head * ZD + 2 * cols[None, :]
    tl.store(DZ + offs, dz0.to(DZ.dtype.element_ty), mask=mask)
    tl.store(DZ + offs + 1, dz1.to(DZ.dtype.element_ty), mask=mask)


def _block_rows(zd: int) -> int:
    return max(1, min(64, 4096 // max(zd, 1)))  # about 4K elements of Z per program


# A 4K-element tile over 256 threads: about 120 registers per thread, where 4 warps needed about 220.
NUM_WARPS = 8


def _forward(z, gamma, beta, inv_freq, start, chunk, eps, out_dtype):
    """The launcher: (Q, K) [B, L, h, zd] in ``out_dtype``."""
    b, length, h, zd = z.shape
    q = torch.empty(z.shape, dtype=out_dtype, device=z.device)
    k = torch.empty(z.shape, dtype=out_dtype, device=z.device)
    rows, block = b * length, _block_rows(zd)
    grid = (triton.cdiv(rows, block), h)
    _fwd_kernel[grid](
        z, gamma, beta, inv_freq, q, k, rows, length, h, start, chunk, 1.0 / math.sqrt(zd), eps,
        ZD=zd, HALF=triton.next_power_of_2(zd // 2), BLOCK_R=block, num_warps=NUM_WARPS,
    )  # fmt: skip
    return q, k


def _backward(dq, dk, z, gamma, inv_freq, start, chunk, eps):
    """The launcher: (dZ, dγ, dβ), the parameters' gradients float32 [2, h * zd]."""
    b, length, h, zd = z.shape
    rows, block = b * length, _block_rows(zd)
    programs = triton.cdiv(rows, block)
    dz = torch.empty_like(z)
    pg = torch.empty(programs, 2, h * zd, dtype=torch.float32, device=z.device)
    pb = torch.empty(programs, 2, h * zd, dtype=torch.float32, device=z.device)
    _bwd_kernel[(programs, h)](
        z, gamma, inv_freq, dq, dk, dz, pg, pb, rows, length, h, start, chunk, 1.0 / math.sqrt(zd), eps,
        ZD=zd, HALF=triton.next_power_of_2(zd // 2), BLOCK_R=block, num_warps=NUM_WARPS,
    )  # fmt: skip
    return dz, pg.sum(0), pb.sum(0)


@torch.library.custom_op(
    "mega_suite::qk_norm_rope_fwd",
    mutates_args=(),
    schema="(Tensor z, Tensor gamma, Tensor beta, Tensor inv_freq, int start, int chunk, float eps, "
    "ScalarType out_dtype) -> (Tensor, Tensor)",
)
def _fwd_op(z, gamma, beta, inv_freq, start, chunk, eps, out_dtype):
    return _forward(z, gamma, beta, inv_freq, start, chunk, eps, out_dtype)


@_fwd_op.register_fake
def _(z, gamma, beta, inv_freq, start, chunk, eps, out_dtype):
    return z.new_empty(z.shape, dtype=out_dtype), z.new_empty(z.shape, dtype=out_dtype)


@torch.library.custom_op(
    "mega_suite::qk_norm_rope_bwd",
    mutates_args=(),
    schema="(Tensor dq, Tensor dk, Tensor z, Tensor gamma, Tensor inv_freq, int start, int chunk, float eps) "
    "-> (Tensor, Tensor, Tensor)",
)
def _bwd_op(dq, dk, z, gamma, inv_freq, start, chunk, eps):
    return _backward(dq, dk, z, gamma, inv_freq, start, chunk, eps)


@_bwd_op.register_fake
def _(dq, dk, z, gamma, inv_freq, start, chunk, eps):
    h_zd = z.shape[2] * z.shape[3]
    part = lambda: z.new_empty(2, h_zd, dtype=torch.float32)  # noqa: E731
    return torch.empty_like(z), part(), part()


class QKNormRopeFunction(torch.autograd.Function):
    """Stores only Z (and the parameters); the backward recomputes the normalisation."""

    @staticmethod
    def forward(ctx, z, gamma, beta, inv_freq, start, chunk, eps, out_dtype):
        q, k = torch.ops.mega_suite.qk_norm_rope_fwd(z, gamma, beta, inv_freq, start, chunk, eps, out_dtype)
        ctx.save_for_backward(z, gamma, inv_freq)
        ctx.args = (start, chunk, eps)
        ctx.dtypes = (gamma.dtype, gamma.dtype)
        return q, k

    @staticmethod
    def backward(ctx, dq, dk):
        z, gamma, inv_freq = ctx.saved_tensors
        dq = torch.zeros_like(z) if dq is None else dq.contiguous()
        dk = torch.zeros_like(z) if dk is None else dk.contiguous()
        dz, dgamma, dbeta = torch.ops.mega_suite.qk_norm_rope_bwd(dq, dk, z, gamma, inv_freq, *ctx.args)
        return dz, dgamma.to(ctx.dtypes[0]), dbeta.to(ctx.dtypes[1]), None, None, None, None, None


def qk_norm_rope(
    z: Tensor, gamma: Tensor, beta: Tensor, inv_freq: Tensor, eps: float, chunk_size: int, start: int,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The fused form of ``reference.qk_norm_rope``; ``inv_freq`` [zd/2] float32 = base^(-2j/zd)."""
    z = z.contiguous()
    return QKNormRopeFunction.apply(
        z, gamma.contiguous(), beta.contiguous(), inv_freq, start, chunk_size, eps, out_dtype
    )
