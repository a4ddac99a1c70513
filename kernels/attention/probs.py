"""Chunked attention by materialised probabilities: cuBLAS GEMMs around two fused Triton softmax kernels.

The path for wide value heads (dv 2048 at the 7B widths), where the fused flash-style kernel
(``kernels.attention.triton``) recomputes QKᵀ and the softmax once per value tile. Per (batch, chunk, head),
with the chunk's queries and keys (c = min(C, L) tokens; a ragged last chunk is padded to c and masked):

    forward   S = Q Kᵀ (GEMM, float32 out)  ->  P, lse = masked softmax(S) (Triton)  ->  O = P V (GEMM)
    backward  S = Q Kᵀ, dP = dO Vᵀ (GEMMs, float32 out)
              P = exp(S - lse), dS = P ⊙ (dP - δ), δ = rowsum(dO ⊙ O) (Triton, elementwise)
              dV = Pᵀ dO, dQ = dS K, dK = dSᵀ Q (GEMMs)

Masks are those of the fused kernel, applied by its own ``_keep_mask`` (softmax scale 1.0; causal j ≤ i; key
padding; DropKey: each logit set to -inf with probability p, no rescaling, decided by the same Philox stream
over the global (batch, head, query, key) index), so both paths drop the same logits for a seed and
:func:`dropkey_mask` (the fused module's) returns them. A row with no kept key outputs 0, gradients 0.

Layout: the GEMMs take strided views of q, k, v [B, L, h, d] and write into O [B, L, h, dv] and the
[B, nc, h, c, c] buffers, one ``torch.bmm`` per group of batches whose strides merge (all of (B, nc, h) when
possible, else one call per head): no copies of q, k, v. S and dP are float32 (cuBLAS's accumulator,
``out_dtype``), so logits and dP - δ are not rounded to 16 bits; P and dS are stored in the input dtype.

Causal chunks can be cut into row blocks of ``row_block`` queries: block r only multiplies keys up to its
own end, so the GEMMs compute (blocks + 1) / (2 blocks) of the square instead of all of it, and the softmax
kernels write P / dS only where some GEMM reads them (zeros above the diagonal inside a block).
Chunks run in groups of at most ``SCRATCH_LOGITS`` logits, which bounds the scratch buffers (S and dP in
float32, P and dS in the input dtype: 12 bytes per logit in backward) at long sequences.

``torch.compile``: the launchers are the custom ops ``mega_suite::probs_attention_fwd`` / ``_bwd`` with fake
implementations, wired by :class:`ProbsAttentionFunction`, as in ``kernels.attention.triton``.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels.attention.triton import (
    SUPPORTED_DTYPES,
    _bwd_preprocess_kernel,
    _keep_mask,
    _mask_args,
    _pow2,
    dropkey_mask,
)

__all__ = [
    "ProbsAttentionFunction",
    "SoftmaxBlocks",
    "block_config",
    "chunk_attention",
    "default_row_block",
    "dropkey_mask",
    "probs_backward",
    "probs_forward",
]

LOG2E = tl.constexpr(1.4426950408889634)
DEBUG_NAN_FILL = os.environ.get("MEGA_SUITE_DEBUG_NAN_FILL", "0") == "1"
# P is recomputed in backward from S = QKᵀ and the saved lse by default: one dk-wide GEMM (dk / (3 (dk + dv))
# of the minimal FLOPs, 4% at dk 256 / dv 2048) against keeping 2 bytes per logit per layer until backward.
SAVE_PROBS = os.environ.get("MEGA_SUITE_ATTENTION_SAVE_PROBS", "0") == "1"
# Quarters: alone, one square timed faster on an H200, but the 7B block with it was slower (bench/GPU_RESULTS.md,
# "Attention row blocks"); gpu-bench's block_variants stage compares them inside the block, in one process.
CAUSAL_ROW_BLOCKS = 4
MIN_BLOCKED_CHUNK = 1024  # shorter causal chunks run as one square (unmeasured)
SCRATCH_LOGITS = 1 << 28  # chunks are processed in groups of at most this many logits (S: 1 GiB in float32)


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _write_end(m_start, c, row_block, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """Columns of a row tile that some GEMM reads: the end of the last row's row block (causal), else c."""
    end = c
    if CAUSAL:
        last_row = tl.minimum(m_start + BLOCK_M, c) - 1
        end = tl.minimum(c, (last_row // row_block + 1) * row_block)
    return end


@triton.jit
def _softmax_fwd_kernel(
    S, P, LSE, KPM, SEED,
    stride_sb, stride_sc, stride_sh, stride_sm, stride_sn,
    stride_pb, stride_pc, stride_ph, stride_pm, stride_pn,
    stride_kpm_b, stride_kpm_l,
    c, chunk0, L, Lp, H, row_block, dropout_p,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, SINGLE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """P = softmax of the kept logits of BLOCK_M rows of S (float32) and lse = log Σ exp (natural units, +inf
    for a row with no kept key). SINGLE: the whole row is one tile (BLOCK_N >= c), read once; else two passes
    (online max / sum, then P)."""
    m_block = tl.program_id(0)
    local = tl.program_id(1).to(tl.int64)  # the chunk's index in the buffers (chunks chunk0.. of the call)
    chunk = chunk0 + tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // H).to(tl.int64)  # 64-bit offsets: B * nc * h * c * c may exceed 2^31
    h = (bh % H).to(tl.int64)
    chunk_start = chunk * c
    chunk_len = tl.minimum(c, L - chunk_start)
    m_start = m_block * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < c  # rows past chunk_len (padding of a ragged last chunk) get P = 0
    rows = offs_m[:, None].to(tl.int64)
    s_rows = S + b * stride_sb + local * stride_sc + h * stride_sh + rows * stride_sm
    p_rows = P + b * stride_pb + local * stride_pc + h * stride_ph + rows * stride_pm
    kpm_row = KPM + b * stride_kpm_b
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    write_end = _write_end(m_start, c, row_block, CAUSAL, BLOCK_M)

    if SINGLE:
        offs_n = tl.arange(0, BLOCK_N)
        keep = _keep_mask(
            offs_m[:, None], offs_n[None, :], chunk_start, chunk_len, L, bh, kpm_row, stride_kpm_l, seed,
            dropout_p, CAUSAL, HAS_KPM, DROPOUT,
        )  # fmt: skip
        # Loads only kept logits: a causal chunk's upper triangle is never read (no GEMM wrote it).
        s = tl.load(s_rows + offs_n[None, :] * stride_sn, mask=keep, other=float("-inf")) * LOG2E
        m = tl.max(s, 1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # a row with nothing kept: 2^(-inf - 0) = 0, not NaN
        e = tl.exp2(s - m_safe[:, None])
        total = tl.sum(e, 1)
        empty = total == 0.0
        p = e / tl.where(empty, 1.0, total)[:, None]
        tl.store(
            p_rows + offs_n[None, :] * stride_pn, p.to(P.dtype.element_ty),
            mask=row_ok[:, None] & (offs_n[None, :] < write_end),
        )  # fmt: skip
        lse2 = tl.where(empty, float("inf"), m_safe + tl.log2(tl.where(empty, 1.0, total)))
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        hi = chunk_len
        if CAUSAL:
            hi = tl.minimum(chunk_len, m_start + BLOCK_M)
        for n_start in range(0, hi, BLOCK_N):
            offs_n = n_start + tl.arange(0, BLOCK_N)
            keep = _keep_mask(
                offs_m[:, None], offs_n[None, :], chunk_start, chunk_len, L, bh, kpm_row, stride_kpm_l, seed,
                dropout_p, CAUSAL, HAS_KPM, DROPOUT,
            )  # fmt: skip
            s = tl.load(s_rows + offs_n[None, :] * stride_sn, mask=keep, other=float("-inf")) * LOG2E
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m_i = m_new
        empty = l_i == 0.0
        lse2 = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        for n_start in range(0, write_end, BLOCK_N):
            offs_n = n_start + tl.arange(0, BLOCK_N)
            keep = _keep_mask(
                offs_m[:, None], offs_n[None, :], chunk_start, chunk_len, L, bh, kpm_row, stride_kpm_l, seed,
                dropout_p, CAUSAL, HAS_KPM, DROPOUT,
            )  # fmt: skip
            s = tl.load(s_rows + offs_n[None, :] * stride_sn, mask=keep, other=float("-inf")) * LOG2E
            p = tl.exp2(s - lse2[:, None])  # dropped / masked: 2^(-inf) = 0; an empty row: lse2 = +inf
            tl.store(
                p_rows + offs_n[None, :] * stride_pn, p.to(P.dtype.element_ty),
                mask=row_ok[:, None] & (offs_n[None, :] < write_end),
            )  # fmt: skip
    tl.store(LSE + bh.to(tl.int64) * Lp + chunk_start + offs_m, lse2 / LOG2E, mask=row_ok)


@triton.jit
def _softmax_bwd_kernel(
    S, P, DP, DS, LSE, DELTA, KPM, SEED,
    stride_sb, stride_sc, stride_sh, stride_sm, stride_sn,
    stride_pb, stride_pc, stride_ph, stride_pm, stride_pn,
    stride_dpb, stride_dpc, stride_dph, stride_dpm, stride_dpn,
    stride_dsb, stride_dsc, stride_dsh, stride_dsm, stride_dsn,
    stride_kpm_b, stride_kpm_l,
    c, chunk0, L, Lp, H, row_block, dropout_p,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, RECOMPUTE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile: dS = P ⊙ (dP - δ). RECOMPUTE: P = exp(S - lse) with the forward's masks,
    written for the dV GEMM; else P is the forward's (masked entries already 0) and only dS is written."""
    n_tiles = tl.cdiv(c, BLOCK_N)
    pid = tl.program_id(0)
    chunk = chunk0 + tl.program_id(1)
    bh = tl.program_id(2)
    m_start = (pid // n_tiles) * BLOCK_M
    n_start = (pid % n_tiles) * BLOCK_N
    write_end = _write_end(m_start, c, row_block, CAUSAL, BLOCK_M)
    if n_start < write_end:  # causal: tiles right of every row block's end are neither read nor written
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        ch = tl.program_id(1).to(tl.int64)  # the chunk's index in the buffers
        chunk_start = chunk * c
        chunk_len = tl.minimum(c, L - chunk_start)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_n = n_start + tl.arange(0, BLOCK_N)
        rows = offs_m[:, None].to(tl.int64)
        cols = offs_n[None, :]
        out_ok = (offs_m[:, None] < c) & (cols < write_end)
        row_ok = offs_m < c
        kpm_row = KPM + b * stride_kpm_b
        if RECOMPUTE:
            seed = 0
            if DROPOUT:
                seed = tl.load(SEED)
            keep = _keep_mask(
                offs_m[:, None], cols, chunk_start, chunk_len, L, bh, kpm_row, stride_kpm_l, seed, dropout_p,
                CAUSAL, HAS_KPM, DROPOUT,
            )  # fmt: skip
            s = tl.load(
                S + b * stride_sb + ch * stride_sc + h * stride_sh + rows * stride_sm + cols * stride_sn,
                mask=keep, other=float("-inf"),
            )  # fmt: skip
            lse = tl.load(LSE + bh.to(tl.int64) * Lp + chunk_start + offs_m, mask=row_ok, other=float("inf"))
            p = tl.exp2((s - lse[:, None]) * LOG2E)  # masked: -inf; an empty row: lse = +inf; both give 0
            tl.store(
                P + b * stride_pb + ch * stride_pc + h * stride_ph + rows * stride_pm + cols * stride_pn,
                p.to(P.dtype.element_ty), mask=out_ok,
            )  # fmt: skip
        else:
            # Saved P is 0 wherever a logit was masked or dropped: only the geometry bounds what dP holds.
            keep = _keep_mask(
                offs_m[:, None], cols, chunk_start, chunk_len, L, bh, kpm_row, stride_kpm_l, 0, dropout_p,
                CAUSAL, False, False,
            )  # fmt: skip
            p = tl.load(
                P + b * stride_pb + ch * stride_pc + h * stride_ph + rows * stride_pm + cols * stride_pn,
                mask=keep, other=0.0,
            ).to(tl.float32)  # fmt: skip
        dp = tl.load(
            DP + b * stride_dpb + ch * stride_dpc + h * stride_dph + rows * stride_dpm + cols * stride_dpn,
            mask=keep, other=0.0,
        )  # fmt: skip
        delta = tl.load(DELTA + bh.to(tl.int64) * Lp + chunk_start + offs_m, mask=row_ok, other=0.0)
        ds = p * (dp - delta[:, None])
        tl.store(
            DS + b * stride_dsb + ch * stride_dsc + h * stride_dsh + rows * stride_dsm + cols * stride_dsn,
            ds.to(DS.dtype.element_ty), mask=out_ok,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Block sizes of the softmax kernels
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoftmaxBlocks:
    """Tile sizes of the two softmax kernels (forward: rows per program and column tile, one-tile rows or
    two passes; backward: a [bwd_m, bwd_n] tile per program)."""

    fwd_m: int
    fwd_n: int
    single: bool
    fwd_warps: int = 4
    bwd_m: int = 32
    bwd_n: int = 128
    bwd_warps: int = 8


_BLOCKS_OVERRIDE: SoftmaxBlocks | None = None


@contextlib.contextmanager
def block_config(blocks: SoftmaxBlocks | None):
    """Run the softmax kernels with fixed tiles inside the ``with`` block (None: the defaults of
    :func:`default_blocks`)."""
    global _BLOCKS_OVERRIDE
    previous, _BLOCKS_OVERRIDE = _BLOCKS_OVERRIDE, blocks
    try:
        yield
    finally:
        _BLOCKS_OVERRIDE = previous


def default_blocks(c: int) -> SoftmaxBlocks:
    """Whole rows of up to 8192 keys in one tile, about 4096 logits per forward program; 32 x 128 backward
    tiles (unmeasured until a GPU run)."""
    if _BLOCKS_OVERRIDE is not None:
        return _BLOCKS_OVERRIDE
    n = _pow2(c)
    if n <= 8192:
        m = max(1, min(16, 4096 // n))
        return SoftmaxBlocks(m, n, True, 4 if m * n <= 2048 else 8, min(32, n), min(128, n))
    return SoftmaxBlocks(1, 4096, False, 8)


def default_row_block(c: int, causal: bool) -> int:
    """Queries per causal row block: c (one square) for bidirectional or short chunks, else c split in
    ``CAUSAL_ROW_BLOCKS`` blocks rounded up to 128 rows (tensor-core friendly GEMM edges)."""
    if not causal or c < MIN_BLOCKED_CHUNK:
        return c
    return min(c, 128 * math.ceil(c / CAUSAL_ROW_BLOCKS / 128))


def _row_blocks(c: int, row_block: int, causal: bool) -> list[tuple[int, int]]:
    """(start, end) of the row blocks; a causal block's GEMMs use keys [0, end)."""
    if not causal:
        return [(0, c)]
    return [(r0, min(c, r0 + row_block)) for r0 in range(0, c, row_block)]


# ----------------------------------------------------------------------------------------------------------
# GEMMs on strided views
# ----------------------------------------------------------------------------------------------------------


def _alloc(shape, dtype, device) -> Tensor:
    if DEBUG_NAN_FILL:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _split(t: Tensor, nc: int, c: int) -> Tensor:
    """[B, nc * c, h, d] -> a [B, nc, h, c, d] view."""
    return t.unflatten(1, (nc, c)).transpose(2, 3)


def _batch_views(*ts: Tensor) -> list[tuple[Tensor, ...]]:
    """3-D views covering the leading [B, nc, h] of 5-D tensors in as few batches as their strides allow:
    all of (B, nc, h) merged where possible, else one call per head (B, nc merged), per (batch, chunk) (the
    heads of one chunk are a strided batch) or per (batch, head), whichever is fewest calls."""
    B, nc, H = ts[0].shape[:3]
    try:
        return [tuple(t.view(-1, *t.shape[-2:]) for t in ts)]
    except RuntimeError:
        pass
    options = [
        (B * nc, lambda: [tuple(t[b, n] for t in ts) for b in range(B) for n in range(nc)]),
        (B * H, lambda: [tuple(t[b, :, i] for t in ts) for b in range(B) for i in range(H)]),
    ]
    try:
        per_head = [tuple(t[:, :, i].view(-1, *t.shape[-2:]) for t in ts) for i in range(H)]
        options.append((H, lambda: per_head))
    except RuntimeError:
        pass
    return min(options, key=lambda option: option[0])[1]()


_OUT_DTYPE_OK = [True]


def _matmul(a: Tensor, b: Tensor, out: Tensor) -> None:
    """out = a @ b over 5-D [B, nc, h, m, k] @ [B, nc, h, k, n] views. A float32 ``out`` from 16-bit inputs
    keeps cuBLAS's float32 accumulator (``out_dtype``)."""
    for a3, b3, o3 in _batch_views(a, b, out):
        if o3.dtype == a3.dtype:
            torch.bmm(a3, b3, out=o3)
        elif a3.is_cuda and _OUT_DTYPE_OK[0]:
            try:
                torch.bmm(a3, b3, out_dtype=o3.dtype, out=o3)
            except RuntimeError as err:  # a torch / cuBLAS without bmm.dtype: 16-bit logits, said once
                _OUT_DTYPE_OK[0] = False
                warnings.warn(
                    f"torch.bmm(out_dtype=float32) failed ({err}); S and dP rounded to {a3.dtype}",
                    stacklevel=2,
                )
                o3.copy_(torch.bmm(a3, b3))
        elif a3.is_cuda:
            o3.copy_(torch.bmm(a3, b3))
        else:  # CPU (interpreter tests) / meta: no bmm.dtype there; the same float32 products
            torch.bmm(a3.to(o3.dtype), b3.to(o3.dtype), out=o3)


def _no_autocast(device: torch.device):
    """The GEMMs run in the inputs' dtype: an enclosing autocast region would recast them."""
    kind = device.type
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------


def _geometry(q: Tensor, chunk_size: int, length: int) -> tuple[int, int]:
    """(c, nc) of inputs padded to nc * c rows."""
    c = min(chunk_size, length)
    padded = q.shape[1]
    if c < 1 or padded % c or padded < length:
        raise ValueError(f"probs attention expects q padded to a multiple of c = {c} rows, got {padded}")
    return c, padded // c


def _check(q: Tensor, k: Tensor, v: Tensor, chunk_size: int, key_padding_mask: Tensor | None, p: float):
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"chunk_attention expects q, k [B, L, h, dk] and v [B, L, h, dv]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"probs chunk_attention needs q, k, v of one dtype in {SUPPORTED_DTYPES}, "
            f"got {(q.dtype, k.dtype, v.dtype)}"
        )
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != tuple(q.shape[:2]):
        raise ValueError(
            f"key_padding_mask must be [B, L] = {tuple(q.shape[:2])}, got {tuple(key_padding_mask.shape)}"
        )
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {p}")


def _chunk_groups(b: int, h: int, nc: int, c: int) -> list[tuple[int, int]]:
    """Chunks [n0, n1) processed together: at most ``SCRATCH_LOGITS`` logits of scratch (S, dP, P, dS) at a
    time, at least one chunk."""
    group = max(1, min(nc, SCRATCH_LOGITS // max(1, b * h * c * c)))
    return [(n0, min(nc, n0 + group)) for n0 in range(0, nc, group)]


def probs_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    seed: Tensor | None,
    chunk_size: int,
    causal: bool,
    dropout_p: float,
    length: int,
    row_block: int,
    save_probs: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k [B, Lp, h, dk], v [B, Lp, h, dv] with Lp a multiple of c = min(chunk_size, length) and rows past
    ``length`` masked; key_padding_mask [B, length] bool or None; seed int64 [1] (read when dropout_p > 0).
    Returns O [B, Lp, h, dv] (q.dtype), lse [B, h, Lp] float32 (natural log, +inf for a row with no kept key)
    and P [B, nc, h, c, c] when ``save_probs`` (else an empty tensor)."""
    b, padded, h, _ = q.shape
    dv = v.shape[-1]
    o = _alloc((b, padded, h, dv), q.dtype, q.device)
    lse = _alloc((b, h, padded), torch.float32, q.device)
    if padded == 0:
        return o, lse, q.new_empty(0)
    c, nc = _geometry(q, chunk_size, length)
    q5, k5, v5, o5 = (_split(t, nc, c) for t in (q, k, v, o))
    blocks = _row_blocks(c, row_block, causal)
    kpm, skb, skl, has_kpm = _mask_args(q, key_padding_mask)
    dropout = dropout_p > 0.0
    cfg = default_blocks(c)
    saved = _alloc((b, nc, h, c, c), q.dtype, q.device) if save_probs else None
    for n0, n1 in _chunk_groups(b, h, nc, c):
        qg, kg, vg, og = (t[:, n0:n1] for t in (q5, k5, v5, o5))
        s = _alloc((b, n1 - n0, h, c, c), torch.float32, q.device)
        with _no_autocast(q.device):
            for r0, r1 in blocks:
                e = r1 if causal else c
                _matmul(qg[..., r0:r1, :], kg[..., :e, :].transpose(-1, -2), s[..., r0:r1, :e])
        probs = saved[:, n0:n1] if save_probs else _alloc(s.shape, q.dtype, q.device)
        _softmax_fwd_kernel[(triton.cdiv(c, cfg.fwd_m), n1 - n0, b * h)](
            s, probs, lse, kpm, seed if dropout else None, *s.stride(), *probs.stride(), skb, skl,
            c, n0, length, padded, h, row_block, float(dropout_p),
            CAUSAL=bool(causal), HAS_KPM=has_kpm, DROPOUT=dropout, SINGLE=cfg.single,
            BLOCK_M=cfg.fwd_m, BLOCK_N=cfg.fwd_n, num_warps=cfg.fwd_warps,
        )  # fmt: skip
        del s
        with _no_autocast(q.device):
            for r0, r1 in blocks:
                e = r1 if causal else c
                _matmul(probs[..., r0:r1, :e], vg[..., :e, :], og[..., r0:r1, :])
    return o, lse, saved if save_probs else q.new_empty(0)


def probs_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    probs: Tensor,
    key_padding_mask: Tensor | None,
    seed: Tensor | None,
    chunk_size: int,
    causal: bool,
    dropout_p: float,
    length: int,
    row_block: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`probs_forward`: do, o [B, Lp, h, dv]; probs the forward's P or empty (then P is
    recomputed from S and lse). Returns dq, dk [B, Lp, h, dk] and dv [B, Lp, h, dv] in the input dtype."""
    b, padded, h, _ = q.shape
    dv_width = v.shape[-1]
    dq = _alloc(q.shape, q.dtype, q.device)
    dk = _alloc(k.shape, k.dtype, k.device)
    dv = _alloc(v.shape, v.dtype, v.device)
    if padded == 0:
        return dq, dk, dv
    c, nc = _geometry(q, chunk_size, length)
    recompute = probs.numel() == 0
    delta = _alloc((b, h, padded), torch.float32, q.device)
    _bwd_preprocess_kernel[(triton.cdiv(padded, 64), b * h)](
        o, do, delta, *o.stride(), *do.stride(), padded, h, DV=dv_width, BLOCK_L=64,
        BLOCK_DV=min(_pow2(dv_width), 128),
    )  # fmt: skip
    views = [_split(t, nc, c) for t in (q, k, v, do, dq, dk, dv)]
    blocks = _row_blocks(c, row_block, causal)
    kpm, skb, skl, has_kpm = _mask_args(q, key_padding_mask)
    dropout = dropout_p > 0.0
    cfg = default_blocks(c)
    for n0, n1 in _chunk_groups(b, h, nc, c):
        qg, kg, vg, dog, dqg, dkg, dvg = (t[:, n0:n1] for t in views)
        shape = (b, n1 - n0, h, c, c)
        p = _alloc(shape, q.dtype, q.device) if recompute else probs[:, n0:n1]
        s = _alloc(shape, torch.float32, q.device) if recompute else p  # saved P: S is never read
        dp = _alloc(shape, torch.float32, q.device)
        with _no_autocast(q.device):
            for r0, r1 in blocks:
                e = r1 if causal else c
                if recompute:
                    _matmul(qg[..., r0:r1, :], kg[..., :e, :].transpose(-1, -2), s[..., r0:r1, :e])
                _matmul(dog[..., r0:r1, :], vg[..., :e, :].transpose(-1, -2), dp[..., r0:r1, :e])
        ds = _alloc(shape, q.dtype, q.device)
        grid = (triton.cdiv(c, cfg.bwd_m) * triton.cdiv(c, cfg.bwd_n), n1 - n0, b * h)
        _softmax_bwd_kernel[grid](
            s, p, dp, ds, lse, delta, kpm, seed if dropout else None,
            *s.stride(), *p.stride(), *dp.stride(), *ds.stride(), skb, skl,
            c, n0, length, padded, h, row_block, float(dropout_p),
            CAUSAL=bool(causal), HAS_KPM=has_kpm, DROPOUT=dropout, RECOMPUTE=recompute,
            BLOCK_M=cfg.bwd_m, BLOCK_N=cfg.bwd_n, num_warps=cfg.bwd_warps,
        )  # fmt: skip
        del s, dp
        with _no_autocast(q.device):
            for r0, r1 in blocks:
                e = r1 if causal else c
                _matmul(ds[..., r0:r1, :e], kg[..., :e, :], dqg[..., r0:r1, :])
                # Key block [r0, r1) is seen by queries r0.. (causal) or by all of them.
                first = r0 if causal else 0
                _matmul(p[..., first:, r0:r1].transpose(-1, -2), dog[..., first:, :], dvg[..., r0:r1, :])
                _matmul(ds[..., first:, r0:r1].transpose(-1, -2), qg[..., first:, :], dkg[..., r0:r1, :])
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------
# Custom ops and autograd
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "mega_suite::probs_attention_fwd",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? seed, int chunk_size, bool causal, "
    "float dropout_p, int length, int row_block, bool save_probs) -> (Tensor, Tensor, Tensor)",
)
def _fwd_op(q, k, v, key_padding_mask, seed, chunk_size, causal, dropout_p, length, row_block, save_probs):
    return probs_forward(
        q, k, v, key_padding_mask, seed, chunk_size, causal, dropout_p, length, row_block, save_probs
    )


@_fwd_op.register_fake
def _(q, k, v, key_padding_mask, seed, chunk_size, causal, dropout_p, length, row_block, save_probs):
    b, padded, h, _ = q.shape
    o = q.new_empty(b, padded, h, v.shape[-1])
    lse = q.new_empty(b, h, padded, dtype=torch.float32)
    if not save_probs or padded == 0:
        return o, lse, q.new_empty(0)
    c = min(chunk_size, length)
    return o, lse, q.new_empty(b, padded // c, h, c, c)


@torch.library.custom_op(
    "mega_suite::probs_attention_bwd",
    mutates_args=(),
    schema="(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor probs, Tensor? key_padding_mask, "
    "Tensor? seed, int chunk_size, bool causal, float dropout_p, int length, int row_block) -> (Tensor, Tensor, Tensor)",
)
def _bwd_op(
    do, q, k, v, o, lse, probs, key_padding_mask, seed, chunk_size, causal, dropout_p, length, row_block
):
    return probs_backward(
        do, q, k, v, o, lse, probs, key_padding_mask, seed, chunk_size, causal, dropout_p, length, row_block
    )


@_bwd_op.register_fake
def _(do, q, k, v, o, lse, probs, key_padding_mask, seed, chunk_size, causal, dropout_p, length, row_block):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class ProbsAttentionFunction(torch.autograd.Function):
    """O = attention by materialised probabilities; saves q, k, v, O, lse (and P with save_probs)."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, seed, chunk_size, causal, dropout_p, length, row_block, save):
        o, lse, probs = torch.ops.mega_suite.probs_attention_fwd(
            q, k, v, key_padding_mask, seed, chunk_size, causal, dropout_p, length, row_block, save
        )
        ctx.save_for_backward(q, k, v, o, lse, probs, key_padding_mask, seed)
        ctx.args = chunk_size, causal, dropout_p, length, row_block
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, probs, key_padding_mask, seed = ctx.saved_tensors
        dq, dk, dv = torch.ops.mega_suite.probs_attention_bwd(
            do, q, k, v, o, lse, probs, key_padding_mask, seed, *ctx.args
        )
        return dq, dk, dv, *([None] * 8)


def chunk_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    chunk_size: int,
    causal: bool,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    seed: Tensor | int | None = None,
    *,
    row_block: int | None = None,
    save_probs: bool | None = None,
) -> Tensor:
    """Softmax attention inside independent chunks of ``chunk_size`` tokens by materialised probabilities.

    Args:
        q, k: [B, L, h, dk] (RoPE already applied, positions restarting per chunk); any dk.
        v: [B, L, h, dv]; any dv.
        chunk_size: C; a length that is not a multiple of C is padded internally (a copy of q, k, v).
        causal: mask keys after the query inside each chunk.
        key_padding_mask: [B, L] bool, True = padding key.
        dropout_p: DropKey probability (each logit set to -inf with probability p, no rescaling).
        seed: DropKey seed (int or int64 [1] tensor on q's device); drawn from torch's generator when None,
            as ``kernels.attention.triton.chunk_attention`` draws it (same seed, same dropped logits).
        row_block: queries per causal row block (default :func:`default_row_block`); ignored when
            bidirectional.
        save_probs: keep P for backward instead of recomputing it (default ``SAVE_PROBS``).

    Returns:
        [B, L, h, dv] in q's dtype; a query with no kept key outputs zeros (and gets zero gradients).
    """
    _check(q, k, v, chunk_size, key_padding_mask, dropout_p)
    if dropout_p > 0.0:
        if seed is None:
            seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q.device)
        elif not isinstance(seed, Tensor):
            seed = torch.tensor([seed], dtype=torch.int64, device=q.device)
    else:
        seed = None
    if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
        key_padding_mask = key_padding_mask != 0
    length = q.shape[1]
    c = max(1, min(chunk_size, length))
    if row_block is None:
        row_block = default_row_block(c, causal)
    if row_block < 1:
        raise ValueError(f"row_block must be >= 1, got {row_block}")
    row_block = min(row_block, c) if causal else c
    pad = -length % c
    if pad:  # the last chunk padded to c rows; the kernels mask positions >= length
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    save = SAVE_PROBS if save_probs is None else bool(save_probs)
    o = ProbsAttentionFunction.apply(
        q, k, v, key_padding_mask, seed, chunk_size, bool(causal), float(dropout_p), length, row_block, save
    )
    return o[:, :length] if pad else o
