"""Q and K from Z in one Triton kernel forward and one backward (docs/architecture.md#normalised-attention).

Two variants compute the same thing; ``VARIANT`` (or ``MEGA_SUITE_QK_NORM_ROPE=heads|rows`` at import) picks
one, and the choice is made on a GPU inside the block (``make gpu-bench``'s block_variants stage):

- ``heads`` (the default): a program owns ``BLOCK_R`` tokens of one head; it loads their Z rows as even and odd
  halves (the RoPE pairs, 2-byte loads at a 4-byte stride) and computes the angles with ``cos`` / ``sin``.
- ``rows``: a program owns ``BLOCK_T`` whole tokens, every head: each Z row is one contiguous load (16-byte
  vectors), de-interleaved into the pairs in registers (``tl.split``), and the rotation reads a cos / sin
  table ``[C, zd/2, 2]`` built once per (zd, base, C, device) in float64 and rounded once. Its backward loops
  over tiles in a fixed number of programs, so the per-program partial sums of dγ and dβ stay small.

Both normalise, scale, offset and rotate Z for Q and for K and write them in the output dtype. The backward
recomputes the normalisation from Z (nothing else is stored), rotates dQ and dK back, and writes dZ and
per-program partial sums of dγ and dβ, which one reduction adds up. Everything runs in float32. The PyTorch
path did this in about fifty ops forward and again in the recompute.
"""

from __future__ import annotations

import math
import os

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


def _autograd(name: str, forward, backward, aux: str) -> type[torch.autograd.Function]:
    """The ops ``mega_suite::<name>_fwd`` / ``_bwd`` around a variant's launchers and the autograd Function over
    them (the variants share a signature; ``aux`` names the fourth tensor: RoPE's inverse frequencies or its
    cos/sin table). Only Z and the parameters are stored: the backward recomputes the normalisation."""
    fwd = torch.library.custom_op(
        f"mega_suite::{name}_fwd",
        forward,
        mutates_args=(),
        schema=f"(Tensor z, Tensor gamma, Tensor beta, Tensor {aux}, int start, int chunk, float eps, "
        "ScalarType out_dtype) -> (Tensor, Tensor)",
    )
    bwd = torch.library.custom_op(
        f"mega_suite::{name}_bwd",
        backward,
        mutates_args=(),
        schema=f"(Tensor dq, Tensor dk, Tensor z, Tensor gamma, Tensor {aux}, int start, int chunk, float eps) "
        "-> (Tensor, Tensor, Tensor)",
    )

    @fwd.register_fake
    def _(z, gamma, beta, aux, start, chunk, eps, out_dtype):
        return z.new_empty(z.shape, dtype=out_dtype), z.new_empty(z.shape, dtype=out_dtype)

    @bwd.register_fake
    def _(dq, dk, z, gamma, aux, start, chunk, eps):
        h_zd = z.shape[2] * z.shape[3]
        part = lambda: z.new_empty(2, h_zd, dtype=torch.float32)  # noqa: E731
        return torch.empty_like(z), part(), part()

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z, gamma, beta, aux, start, chunk, eps, out_dtype):
            q, k = fwd(z, gamma, beta, aux, start, chunk, eps, out_dtype)
            ctx.save_for_backward(z, gamma, aux)
            ctx.args = (start, chunk, eps)
            ctx.dtypes = (gamma.dtype, beta.dtype)
            return q, k

        @staticmethod
        def backward(ctx, dq, dk):
            z, gamma, aux = ctx.saved_tensors
            dq = torch.zeros_like(z) if dq is None else dq.contiguous()
            dk = torch.zeros_like(z) if dk is None else dk.contiguous()
            dz, dgamma, dbeta = bwd(dq, dk, z, gamma, aux, *ctx.args)
            return dz, dgamma.to(ctx.dtypes[0]), dbeta.to(ctx.dtypes[1]), None, None, None, None, None

    Function.__name__ = Function.__qualname__ = "".join(part.title() for part in name.split("_")) + "Function"
    return Function


QKNormRopeFunction = _autograd("qk_norm_rope", _forward, _backward, "inv_freq")


def qk_norm_rope(
    z: Tensor, gamma: Tensor, beta: Tensor, inv_freq: Tensor, eps: float, chunk_size: int, start: int,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The fused form of ``reference.qk_norm_rope``; ``inv_freq`` [zd/2] float32 = base^(-2j/zd)."""
    z = z.contiguous()
    return QKNormRopeFunction.apply(
        z, gamma.contiguous(), beta.contiguous(), inv_freq, start, chunk_size, eps, out_dtype
    )


# ---------------------------------------------------------------------------------------------- the rows variant

VARIANTS = ("heads", "rows")
VARIANT = os.environ.get("MEGA_SUITE_QK_NORM_ROPE", "heads")
if VARIANT not in VARIANTS:
    raise ValueError(f"MEGA_SUITE_QK_NORM_ROPE={VARIANT!r}; expected one of {VARIANTS}")


@triton.jit
def _row_tile(rows, rows_total, H: tl.constexpr, ZD: tl.constexpr, HP: tl.constexpr, ZDP: tl.constexpr):
    """Offsets [BLOCK_T, HP, ZDP] of whole tokens' rows (every head) in a [rows, H * ZD] tensor, and the mask."""
    heads = tl.arange(0, HP)
    cols = tl.arange(0, ZDP)
    offs = rows[:, None, None] * (H * ZD) + heads[None, :, None] * ZD + cols[None, None, :]
    mask = (rows < rows_total)[:, None, None]
    if HP != H or ZDP != ZD:  # padded heads or columns; otherwise the mask is constant along a row
        mask = mask & ((heads < H)[None, :, None] & (cols < ZD)[None, None, :])
    return offs, mask


@triton.jit
def _pairs(x, BLOCK_T: tl.constexpr, HP: tl.constexpr, HALF: tl.constexpr):
    """[BLOCK_T, HP, 2 HALF] -> its even and odd columns, each [BLOCK_T, HP, HALF], in registers."""
    return tl.split(tl.reshape(x, (BLOCK_T, HP, HALF, 2)))


@triton.jit
def _interleave(even, odd, BLOCK_T: tl.constexpr, HP: tl.constexpr, HALF: tl.constexpr):
    return tl.reshape(tl.join(even, odd), (BLOCK_T, HP, 2 * HALF))


@triton.jit
def _row_params(ptr, which, H: tl.constexpr, ZD: tl.constexpr, HP: tl.constexpr, HALF: tl.constexpr):
    """Even and odd entries [HP, HALF] of row ``which`` (0: Q, 1: K) of a [2, H * ZD] parameter."""
    heads = tl.arange(0, HP)
    cols = tl.arange(0, 2 * HALF)
    mask = (heads < H)[:, None] & (cols < ZD)[None, :]
    x = tl.load(ptr + which * H * ZD + heads[:, None] * ZD + cols[None, :], mask=mask, other=0.0)
    return tl.split(tl.reshape(x.to(tl.float32), (HP, HALF, 2)))


@triton.jit
def _cos_sin(
    TAB, rows, rows_total, L, start, chunk, ZD: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr
):
    """cos and sin [BLOCK_T, 1, HALF] of each token's position (start + l) mod C, from the [C, ZD/2, 2] table."""
    pos = (rows % L + start) % chunk
    cols = tl.arange(0, 2 * HALF)
    mask = (rows < rows_total)[:, None] & (cols < ZD)[None, :]
    cs = tl.load(TAB + pos[:, None] * ZD + cols[None, :], mask=mask, other=0.0)
    c, s = tl.split(tl.reshape(cs, (BLOCK_T, HALF, 2)))
    return c[:, None, :], s[:, None, :]


@triton.jit
def _rows_fwd_kernel(
    Z, G, BETA, TAB, Q, K, rows_total, L, start, chunk, scale, eps,
    H: tl.constexpr, ZD: tl.constexpr, HP: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # tokens of the flattened [B * L]
    offs, mask = _row_tile(rows, rows_total, H, ZD, HP, 2 * HALF)
    z0, z1 = _pairs(tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32), BLOCK_T, HP, HALF)
    rstd = tl.rsqrt((tl.sum(z0 * z0, 2) + tl.sum(z1 * z1, 2)) / ZD + eps)[:, :, None]
    zh0, zh1 = z0 * rstd, z1 * rstd
    c, s = _cos_sin(TAB, rows, rows_total, L, start, chunk, ZD, HALF, BLOCK_T)
    for which in tl.static_range(2):
        g0, g1 = _row_params(G, which, H, ZD, HP, HALF)
        b0, b1 = _row_params(BETA, which, H, ZD, HP, HALF)
        a0 = zh0 * ((1 + g0) * scale)[None] + b0[None]
        a1 = zh1 * ((1 + g1) * scale)[None] + b1[None]
        out = Q if which == 0 else K
        rotated = _interleave(a0 * c - a1 * s, a0 * s + a1 * c, BLOCK_T, HP, HALF)
        tl.store(out + offs, rotated.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _unrotate(D, offs, mask, c, s, BLOCK_T: tl.constexpr, HP: tl.constexpr, HALF: tl.constexpr):
    """The gradient before RoPE (the rotation's transpose) of a cotangent tile, as even and odd columns."""
    d0, d1 = _pairs(tl.load(D + offs, mask=mask, other=0.0).to(tl.float32), BLOCK_T, HP, HALF)
    return d0 * c + d1 * s, d1 * c - d0 * s


@triton.jit
def _rows_bwd_kernel(
    Z, G, TAB, DQ, DK, DZ, PG, PB, rows_total, L, start, chunk, scale, eps, tiles,
    H: tl.constexpr, ZD: tl.constexpr, HP: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    gq0, gq1 = _row_params(G, 0, H, ZD, HP, HALF)
    gk0, gk1 = _row_params(G, 1, H, ZD, HP, HALF)
    sq0, sq1 = ((1 + gq0) * scale)[None], ((1 + gq1) * scale)[None]
    sk0, sk1 = ((1 + gk0) * scale)[None], ((1 + gk1) * scale)[None]
    # this program's sums over its tokens: dβ (the gradient before RoPE) and dγ / scale (times ẑ)
    bq0 = tl.zeros([HP, HALF], dtype=tl.float32)
    bq1, bk0, bk1 = bq0, bq0, bq0
    gq0_acc, gq1_acc, gk0_acc, gk1_acc = bq0, bq0, bq0, bq0
    for tile in range(pid, tiles, tl.num_programs(0)):  # a fixed number of programs, each its tiles in order
        rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        offs, mask = _row_tile(rows, rows_total, H, ZD, HP, 2 * HALF)
        z0, z1 = _pairs(tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32), BLOCK_T, HP, HALF)
        rstd = tl.rsqrt((tl.sum(z0 * z0, 2) + tl.sum(z1 * z1, 2)) / ZD + eps)[:, :, None]
        zh0, zh1 = z0 * rstd, z1 * rstd
        c, s = _cos_sin(TAB, rows, rows_total, L, start, chunk, ZD, HALF, BLOCK_T)
        a0, a1 = _unrotate(DQ, offs, mask, c, s, BLOCK_T, HP, HALF)  # Q's share, then K's
        bq0 += tl.sum(a0, 0)
        bq1 += tl.sum(a1, 0)
        gq0_acc += tl.sum(a0 * zh0, 0)
        gq1_acc += tl.sum(a1 * zh1, 0)
        dzh0, dzh1 = a0 * sq0, a1 * sq1
        a0, a1 = _unrotate(DK, offs, mask, c, s, BLOCK_T, HP, HALF)
        bk0 += tl.sum(a0, 0)
        bk1 += tl.sum(a1, 0)
        gk0_acc += tl.sum(a0 * zh0, 0)
        gk1_acc += tl.sum(a1 * zh1, 0)
        dzh0 += a0 * sk0
        dzh1 += a1 * sk1
        # d(x r)/dx: r (dy - ẑ mean(dy ẑ)) for ẑ = x r, r = 1 / sqrt(mean(x²) + eps)
        dot = ((tl.sum(dzh0 * zh0, 2) + tl.sum(dzh1 * zh1, 2)) / ZD)[:, :, None]
        dz = _interleave(rstd * (dzh0 - zh0 * dot), rstd * (dzh1 - zh1 * dot), BLOCK_T, HP, HALF)
        tl.store(DZ + offs, dz.to(DZ.dtype.element_ty), mask=mask)
    heads = tl.arange(0, HP)
    cols = tl.arange(0, 2 * HALF)
    part = heads[:, None] * ZD + cols[None, :]  # partial sums [programs, 2, H * ZD]
    pmask = (heads < H)[:, None] & (cols < ZD)[None, :]
    q_part, k_part = (pid * 2) * H * ZD + part, (pid * 2 + 1) * H * ZD + part
    tl.store(PB + q_part, tl.reshape(tl.join(bq0, bq1), (HP, 2 * HALF)), mask=pmask)
    tl.store(PB + k_part, tl.reshape(tl.join(bk0, bk1), (HP, 2 * HALF)), mask=pmask)
    tl.store(PG + q_part, tl.reshape(tl.join(gq0_acc, gq1_acc), (HP, 2 * HALF)) * scale, mask=pmask)
    tl.store(PG + k_part, tl.reshape(tl.join(gk0_acc, gk1_acc), (HP, 2 * HALF)) * scale, mask=pmask)


ROWS_TILE = (
    4096  # elements of Z per forward tile (padded heads x padded width x BLOCK_T), as the heads variant
)
# The backward holds about a dozen tiles live: 1024 elements over 4 warps (8 per thread, 16-byte bf16 loads) is
# 96 registers on sm_90, where 2048 over 8 warps is 127 and 4096 over 8 warps 242 (Triton 3.6).
ROWS_BWD_TILE, ROWS_BWD_WARPS = 1024, 4
ROWS_BWD_PROGRAMS = 512  # the backward's programs, each looping over its tiles: one wave on an H100 or H200
MAX_TABLE_ENTRIES = 1 << 24  # C x zd / 2 beyond this (a 128 MB table) runs the heads variant


def _rows_shape(h: int, zd: int, tile: int | None = None) -> dict:
    hp, half = triton.next_power_of_2(h), triton.next_power_of_2(zd // 2)
    return dict(H=h, ZD=zd, HP=hp, HALF=half, BLOCK_T=max(1, (tile or ROWS_TILE) // (hp * 2 * half)))


def _rows_forward(z, gamma, beta, table, start, chunk, eps, out_dtype):
    """The launcher of the rows variant: (Q, K) [B, L, h, zd] in ``out_dtype``."""
    b, length, h, zd = z.shape
    q = torch.empty(z.shape, dtype=out_dtype, device=z.device)
    k = torch.empty(z.shape, dtype=out_dtype, device=z.device)
    shape = _rows_shape(h, zd)
    rows = b * length
    _rows_fwd_kernel[(triton.cdiv(rows, shape["BLOCK_T"]),)](
        z, gamma, beta, table, q, k, rows, length, start, chunk, 1.0 / math.sqrt(zd), eps,
        **shape, num_warps=NUM_WARPS,
    )  # fmt: skip
    return q, k


def _rows_backward(dq, dk, z, gamma, table, start, chunk, eps):
    """The launcher of the rows variant's backward: (dZ, dγ, dβ), the parameters' gradients float32 [2, h zd]."""
    b, length, h, zd = z.shape
    shape = _rows_shape(h, zd, ROWS_BWD_TILE)
    rows = b * length
    tiles = triton.cdiv(rows, shape["BLOCK_T"])
    programs = min(tiles, ROWS_BWD_PROGRAMS)
    dz = torch.empty_like(z)
    pg = torch.empty(programs, 2, h * zd, dtype=torch.float32, device=z.device)
    pb = torch.empty(programs, 2, h * zd, dtype=torch.float32, device=z.device)
    _rows_bwd_kernel[(programs,)](
        z, gamma, table, dq, dk, dz, pg, pb, rows, length, start, chunk, 1.0 / math.sqrt(zd), eps, tiles,
        **shape, num_warps=ROWS_BWD_WARPS,
    )  # fmt: skip
    return dz, pg.sum(0), pb.sum(0)


QKNormRopeRowsFunction = _autograd("qk_norm_rope_rows", _rows_forward, _rows_backward, "table")


def cos_sin_table(zd: int, base: float, chunk: int, device: torch.device) -> Tensor:
    """[C, zd/2, 2] float32: cos and sin of p base^(-2j/zd) for positions p < C, computed in float64 and rounded
    once (the float32 product p base^(-2j/zd) alone is off by up to p x 6e-8 radians)."""
    inv = base ** (-torch.arange(0, zd, 2, device=device, dtype=torch.float64) / zd)
    angle = torch.arange(chunk, device=device, dtype=torch.float64)[:, None] * inv
    return torch.stack([angle.cos(), angle.sin()], -1).float()


def rows_fit(zd: int, chunk: int) -> bool:
    """Whether the rows variant's table for this width and chunk is small enough to build."""
    return chunk * (zd // 2) <= MAX_TABLE_ENTRIES


def qk_norm_rope_rows(
    z: Tensor, gamma: Tensor, beta: Tensor, table: Tensor, eps: float, chunk_size: int, start: int,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The rows variant of ``reference.qk_norm_rope``; ``table`` = ``cos_sin_table(zd, base, chunk_size)``."""
    z = z.contiguous()
    return QKNormRopeRowsFunction.apply(
        z, gamma.contiguous(), beta.contiguous(), table, start, chunk_size, eps, out_dtype
    )
