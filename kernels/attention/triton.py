"""Fused chunked attention in Triton (docs/architecture.md#normalised-attention): flash-attention-2 inside block-diagonal chunks, with DropKey.

What one call computes, per batch b, head h and chunk [s, s + c) of the sequence (c = min(C, L); the last
chunk may be shorter):

    S = Q_chunk K_chunkᵀ                          (softmax scale 1.0: Q, K arrive normalised and scaled)
    S[i, j] = -inf   where key j is padding, j > i (causal), j ≥ L, or DropKey drops (i, j)
    O = softmax(S) V_chunk                        (a row whose logits are all -inf outputs zeros)

DropKey (docs/architecture.md#normalised-attention): each pre-softmax logit is dropped (set to -inf, no rescaling) with probability p. The
decision comes from Philox, ``tl.rand(seed, offset)`` with the global (batch, head, query, key) index

    offset = ((b * H + h) * L + i) * L + j        (i, j: positions in the whole sequence, int64)

so the backward kernels regenerate exactly the same mask, and :func:`dropkey_mask` returns it for tests.

Kernels (one program = one tile; grid axes (tile within chunk, chunk, batch * head)):

- ``_fwd_kernel``: a query block of one chunk visits only the key blocks of that chunk (causal: up to the
  diagonal) with the online softmax in float32, writing O and the log-sum-exp (log2 units, +inf for an
  empty row) -- never the C x C matrix. A value width wider than one tile (dv up to 2048 and beyond) is
  split across programs, each recomputing QKᵀ for its dv tile: the QKᵀ FLOPs grow by the number of value
  tiles (dk 256, dv 2048 in 256-wide tiles: 8 x 256 + 2048 multiply-adds per logit instead of 256 + 2048,
  about 1.8x), the price of never holding a [BLOCK_M, 2048] accumulator.
- ``_bwd_preprocess_kernel``: delta = rowsum(dO * O).
- ``_bwd_dkdv_kernel``: a key block loops over the query blocks of its chunk; dK always, dV too when the
  whole value width fits one tile (``FUSE_DV``). Otherwise ``_bwd_dv_kernel`` computes dV with the value
  width tiled across programs, and dP = dO Vᵀ is accumulated over value tiles inside the dK program.
- ``_bwd_dq_kernel``: a query block loops over the key blocks of its chunk.
  No atomics anywhere: every output element is written by exactly one program, so results are deterministic.

On a GPU the block sizes are autotuned (key: chunk size, head widths, causal, dtypes). Under the Triton
interpreter (``TRITON_INTERPRET=1``, CPU tensors, float32 / float16 only) a single small configuration is
used, and tests may force any configuration with :func:`kernel_config`.

``torch.compile``: the launchers are registered as the custom ops ``mega_suite::chunk_attention_fwd`` and
``mega_suite::chunk_attention_bwd`` (``torch.library.custom_op`` with fake implementations), and
:class:`ChunkAttentionFunction` wires them together, so dynamo traces through without graph breaks
(tested with ``fullgraph=True``) and inductor calls the kernels as opaque externs. ``torch.library.triton_op``
would let inductor see inside the kernels, but it was not used: it cannot be exercised without a GPU here
(the tests run the interpreter on CPU tensors), and the opaque op loses nothing that matters for a kernel
that already fuses the whole attention. The DropKey seed is an int64 tensor drawn from the torch generator
of the input device *outside* the op, so the op stays a pure function of its inputs and activation
checkpointing (which restores the RNG state) replays the same mask.

Debugging: ``MEGA_SUITE_DEBUG_NAN_FILL=1`` (or ``DEBUG_NAN_FILL = True``) allocates every output pre-filled
with NaN, so an element no program writes shows up.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = [
    "ChunkAttentionFunction",
    "KernelConfig",
    "attention_backward",
    "attention_forward",
    "chunk_attention",
    "dropkey_mask",
    "kernel_config",
]

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr global: readable inside the kernels
MAX_HEAD_DIM = 256  # Q/K head width limit (registers: a [BLOCK, dk] tile lives in every program)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEBUG_NAN_FILL = os.environ.get("MEGA_SUITE_DEBUG_NAN_FILL", "0") == "1"


# ----------------------------------------------------------------------------------------------------------
# Shared pieces of the kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _dropkey_uniform(seed, bh, q_pos, k_pos, L):
    """U(0, 1) for logit (bh, q_pos, k_pos); q_pos, k_pos are positions in the whole sequence."""
    offset = (bh.to(tl.int64) * L + q_pos) * L + k_pos
    return tl.rand(seed, offset)


@triton.jit
def _keep_mask(
    q_idx, k_idx, chunk_start, chunk_len, L, bh, kpm_row, stride_kpm_l, seed, dropout_p,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr,
):  # fmt: skip
    """Which logits survive. q_idx, k_idx: positions inside the chunk, broadcastable 2-D index blocks
    ([M, 1] with [1, N], or [1, M] with [N, 1] in the transposed backward tiles)."""
    keep = (q_idx < chunk_len) & (k_idx < chunk_len)
    if CAUSAL:
        keep = keep & (k_idx <= q_idx)
    if HAS_KPM:
        pad = tl.load(kpm_row + (chunk_start + k_idx) * stride_kpm_l, mask=k_idx < chunk_len, other=1)
        keep = keep & (pad == 0)
    if DROPOUT:
        u = _dropkey_uniform(seed, bh, chunk_start + q_idx, chunk_start + k_idx, L)
        keep = keep & (u >= dropout_p)
    return keep


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_kernel(
    Q, K, V, KPM, SEED, O, LSE,
    stride_qb, stride_ql, stride_qh, stride_qd,
    stride_kb, stride_kl, stride_kh, stride_kd,
    stride_vb, stride_vl, stride_vh, stride_vd,
    stride_ob, stride_ol, stride_oh, stride_od,
    stride_kpm_b, stride_kpm_l,
    L, H, dropout_p,
    CHUNK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    NUM_DV_TILES: tl.constexpr = (DV + BLOCK_DV - 1) // BLOCK_DV
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    bh = tl.program_id(2)
    m_block = pid // NUM_DV_TILES
    dv_tile = pid % NUM_DV_TILES
    b = (bh // H).to(tl.int64)  # 64-bit pointer offsets: B * L * h * d may exceed 2^31
    h = bh % H
    chunk_start = chunk * CHUNK
    row0 = chunk_start.to(tl.int64)
    chunk_len = tl.minimum(CHUNK, L - chunk_start)
    m_start = m_block * BLOCK_M

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = dv_tile * BLOCK_DV + tl.arange(0, BLOCK_DV)
    row_ok = offs_m < chunk_len
    q_ptrs = Q + b * stride_qb + h * stride_qh + (row0 + offs_m[:, None]) * stride_ql
    q = tl.load(
        q_ptrs + offs_dk[None, :] * stride_qd, mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0
    )
    k_base = K + b * stride_kb + h * stride_kh + row0 * stride_kl
    v_base = V + b * stride_vb + h * stride_vh + row0 * stride_vl
    kpm_row = KPM + b * stride_kpm_b
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the log2-scaled logits
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of 2^(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = chunk_len
    if CAUSAL:
        hi = tl.minimum(chunk_len, m_start + BLOCK_M)
    for n_start in range(0, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < chunk_len
        k = tl.load(
            k_base + offs_n[:, None] * stride_kl + offs_dk[None, :] * stride_kd,
            mask=col_ok[:, None] & (offs_dk[None, :] < DK), other=0.0,
        )  # fmt: skip
        v = tl.load(
            v_base + offs_n[:, None] * stride_vl + offs_dv[None, :] * stride_vd,
            mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * LOG2E
        keep = _keep_mask(
            offs_m[:, None], offs_n[None, :], chunk_start, chunk_len, L, bh, kpm_row, stride_kpm_l, seed,
            dropout_p, CAUSAL, HAS_KPM, DROPOUT,
        )  # fmt: skip
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing kept so far has m_new = -inf: subtract 0 instead, so 2^(-inf) = 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]  # acc is 0 on an empty row: the output is 0
    o_ptrs = O + b * stride_ob + h * stride_oh + (row0 + offs_m[:, None]) * stride_ol
    tl.store(
        o_ptrs + offs_dv[None, :] * stride_od, o.to(O.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < DV),
    )  # fmt: skip
    # +inf on an empty row makes the backward's 2^(s - lse) exactly 0 there.
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    if dv_tile == 0:
        tl.store(LSE + bh.to(tl.int64) * L + chunk_start + offs_m, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA,
    stride_ob, stride_ol, stride_oh, stride_od,
    stride_dob, stride_dol, stride_doh, stride_dod,
    L, H,
    DV: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """delta[b, h, l] = Σ_d dO[b, l, h, d] O[b, l, h, d] = rowsum(dP ⊙ P), the softmax backward's shift."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit pointer offsets: B * L * h * d may exceed 2^31
    h = bh % H
    offs_l = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    rows = offs_l.to(tl.int64)
    acc = tl.zeros([BLOCK_L], tl.float32)
    for d_start in range(0, DV, BLOCK_DV):
        offs_d = d_start + tl.arange(0, BLOCK_DV)
        mask = (offs_l[:, None] < L) & (offs_d[None, :] < DV)
        o = tl.load(
            O + b * stride_ob + h * stride_oh + rows[:, None] * stride_ol + offs_d[None, :] * stride_od,
            mask=mask, other=0.0,
        )  # fmt: skip
        do = tl.load(
            DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dol + offs_d[None, :] * stride_dod,
            mask=mask, other=0.0,
        )  # fmt: skip
        acc += tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * L + offs_l, acc, mask=offs_l < L)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, KPM, SEED, LSE, DELTA, DK_OUT, DV_OUT,
    stride_qb, stride_ql, stride_qh, stride_qd,
    stride_kb, stride_kl, stride_kh, stride_kd,
    stride_vb, stride_vl, stride_vh, stride_vd,
    stride_dob, stride_dol, stride_doh, stride_dod,
    stride_dkb, stride_dkl, stride_dkh, stride_dkd,
    stride_dvb, stride_dvl, stride_dvh, stride_dvd,
    stride_kpm_b, stride_kpm_l,
    L, H, dropout_p,
    CHUNK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FUSE_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """One key block: dK = Σ_queries dSᵀ Q (and, FUSE_DV, dV = Σ_queries Pᵀ dO). Tiles are transposed
    ([keys, queries]) so the accumulations are plain row-major dots."""
    n_block = tl.program_id(0)
    chunk = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // H).to(tl.int64)  # 64-bit pointer offsets: B * L * h * d may exceed 2^31
    h = bh % H
    chunk_start = chunk * CHUNK
    row0 = chunk_start.to(tl.int64)
    chunk_len = tl.minimum(CHUNK, L - chunk_start)
    n_start = n_block * BLOCK_N

    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < chunk_len
    k = tl.load(
        K + b * stride_kb + h * stride_kh + (row0 + offs_n[:, None]) * stride_kl + offs_dk[None, :] * stride_kd,
        mask=col_ok[:, None] & (offs_dk[None, :] < DK), other=0.0,
    )  # fmt: skip
    v_base = V + b * stride_vb + h * stride_vh + (row0 + offs_n[:, None]) * stride_vl
    if FUSE_DV:
        v = tl.load(
            v_base + offs_dv[None, :] * stride_vd, mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0
        )
        dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    dk_acc = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    q_base = Q + b * stride_qb + h * stride_qh + row0 * stride_ql
    do_base = DO + b * stride_dob + h * stride_doh + row0 * stride_dol
    kpm_row = KPM + b * stride_kpm_b
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)

    lo = 0
    if CAUSAL:
        lo = (n_start // BLOCK_M) * BLOCK_M  # earlier query blocks see none of these keys
    for m_start in range(lo, chunk_len, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < chunk_len
        q = tl.load(
            q_base + offs_m[None, :] * stride_ql + offs_dk[:, None] * stride_qd,
            mask=row_ok[None, :] & (offs_dk[:, None] < DK),
            other=0.0,
        )  # qᵀ: [BLOCK_DK, BLOCK_M]
        lse = tl.load(LSE + bh.to(tl.int64) * L + chunk_start + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA + bh.to(tl.int64) * L + chunk_start + offs_m, mask=row_ok, other=0.0)
        s_t = tl.dot(k, q, input_precision=INPUT_PRECISION) * LOG2E  # [BLOCK_N, BLOCK_M]
        keep = _keep_mask(
            offs_m[None, :], offs_n[:, None], chunk_start, chunk_len, L, bh, kpm_row, stride_kpm_l, seed,
            dropout_p, CAUSAL, HAS_KPM, DROPOUT,
        )  # fmt: skip
        p_t = tl.exp2(tl.where(keep, s_t, float("-inf")) - lse[None, :])
        if FUSE_DV:
            do = tl.load(
                do_base + offs_m[:, None] * stride_dol + offs_dv[None, :] * stride_dod,
                mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0,
            )  # fmt: skip
            dv_acc += tl.dot(p_t.to(do.dtype), do, input_precision=INPUT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        else:
            dp_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for d_start in range(0, DV, BLOCK_DV):
                offs_d = d_start + offs_dv
                v_tile = tl.load(
                    v_base + offs_d[None, :] * stride_vd,
                    mask=col_ok[:, None] & (offs_d[None, :] < DV),
                    other=0.0,
                )
                do_t = tl.load(
                    do_base + offs_m[None, :] * stride_dol + offs_d[:, None] * stride_dod,
                    mask=row_ok[None, :] & (offs_d[:, None] < DV),
                    other=0.0,
                )  # dOᵀ tile: [BLOCK_DV, BLOCK_M]
                dp_t += tl.dot(v_tile, do_t, input_precision=INPUT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])  # dS = P ⊙ (dP - delta); dropped / masked logits: P = 0
        dk_acc += tl.dot(ds_t.to(q.dtype), tl.trans(q), input_precision=INPUT_PRECISION)

    tl.store(
        DK_OUT + b * stride_dkb + h * stride_dkh + (row0 + offs_n[:, None]) * stride_dkl
        + offs_dk[None, :] * stride_dkd,
        dk_acc.to(DK_OUT.dtype.element_ty), mask=col_ok[:, None] & (offs_dk[None, :] < DK),
    )  # fmt: skip
    if FUSE_DV:
        tl.store(
            DV_OUT + b * stride_dvb + h * stride_dvh + (row0 + offs_n[:, None]) * stride_dvl
            + offs_dv[None, :] * stride_dvd,
            dv_acc.to(DV_OUT.dtype.element_ty), mask=col_ok[:, None] & (offs_dv[None, :] < DV),
        )  # fmt: skip


@triton.jit
def _bwd_dv_kernel(
    Q, K, DO, KPM, SEED, LSE, DV_OUT,
    stride_qb, stride_ql, stride_qh, stride_qd,
    stride_kb, stride_kl, stride_kh, stride_kd,
    stride_dob, stride_dol, stride_doh, stride_dod,
    stride_dvb, stride_dvl, stride_dvh, stride_dvd,
    stride_kpm_b, stride_kpm_l,
    L, H, dropout_p,
    CHUNK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """dV = Σ_queries Pᵀ dO for one (key block, value tile): the path for value widths wider than a tile."""
    NUM_DV_TILES: tl.constexpr = (DV + BLOCK_DV - 1) // BLOCK_DV
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    bh = tl.program_id(2)
    n_block = pid // NUM_DV_TILES
    dv_tile = pid % NUM_DV_TILES
    b = (bh // H).to(tl.int64)  # 64-bit pointer offsets: B * L * h * d may exceed 2^31
    h = bh % H
    chunk_start = chunk * CHUNK
    row0 = chunk_start.to(tl.int64)
    chunk_len = tl.minimum(CHUNK, L - chunk_start)
    n_start = n_block * BLOCK_N

    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = dv_tile * BLOCK_DV + tl.arange(0, BLOCK_DV)
    col_ok = offs_n < chunk_len
    k = tl.load(
        K + b * stride_kb + h * stride_kh + (row0 + offs_n[:, None]) * stride_kl + offs_dk[None, :] * stride_kd,
        mask=col_ok[:, None] & (offs_dk[None, :] < DK), other=0.0,
    )  # fmt: skip
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    q_base = Q + b * stride_qb + h * stride_qh + row0 * stride_ql
    do_base = DO + b * stride_dob + h * stride_doh + row0 * stride_dol
    kpm_row = KPM + b * stride_kpm_b
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)

    lo = 0
    if CAUSAL:
        lo = (n_start // BLOCK_M) * BLOCK_M
    for m_start in range(lo, chunk_len, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < chunk_len
        q = tl.load(
            q_base + offs_m[None, :] * stride_ql + offs_dk[:, None] * stride_qd,
            mask=row_ok[None, :] & (offs_dk[:, None] < DK), other=0.0,
        )  # fmt: skip
        lse = tl.load(LSE + bh.to(tl.int64) * L + chunk_start + offs_m, mask=row_ok, other=float("inf"))
        s_t = tl.dot(k, q, input_precision=INPUT_PRECISION) * LOG2E
        keep = _keep_mask(
            offs_m[None, :], offs_n[:, None], chunk_start, chunk_len, L, bh, kpm_row, stride_kpm_l, seed,
            dropout_p, CAUSAL, HAS_KPM, DROPOUT,
        )  # fmt: skip
        p_t = tl.exp2(tl.where(keep, s_t, float("-inf")) - lse[None, :])
        do = tl.load(
            do_base + offs_m[:, None] * stride_dol + offs_dv[None, :] * stride_dod,
            mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0,
        )  # fmt: skip
        dv_acc += tl.dot(p_t.to(do.dtype), do, input_precision=INPUT_PRECISION)

    tl.store(
        DV_OUT + b * stride_dvb + h * stride_dvh + (row0 + offs_n[:, None]) * stride_dvl
        + offs_dv[None, :] * stride_dvd,
        dv_acc.to(DV_OUT.dtype.element_ty), mask=col_ok[:, None] & (offs_dv[None, :] < DV),
    )  # fmt: skip


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, KPM, SEED, LSE, DELTA, DQ_OUT,
    stride_qb, stride_ql, stride_qh, stride_qd,
    stride_kb, stride_kl, stride_kh, stride_kd,
    stride_vb, stride_vl, stride_vh, stride_vd,
    stride_dob, stride_dol, stride_doh, stride_dod,
    stride_dqb, stride_dql, stride_dqh, stride_dqd,
    stride_kpm_b, stride_kpm_l,
    L, H, dropout_p,
    CHUNK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """One query block: dQ = Σ_keys dS K, dP = dO Vᵀ accumulated over value tiles."""
    m_block = tl.program_id(0)
    chunk = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // H).to(tl.int64)  # 64-bit pointer offsets: B * L * h * d may exceed 2^31
    h = bh % H
    chunk_start = chunk * CHUNK
    row0 = chunk_start.to(tl.int64)
    chunk_len = tl.minimum(CHUNK, L - chunk_start)
    m_start = m_block * BLOCK_M

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < chunk_len
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + (row0 + offs_m[:, None]) * stride_ql + offs_dk[None, :] * stride_qd,
        mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0,
    )  # fmt: skip
    lse = tl.load(LSE + bh.to(tl.int64) * L + chunk_start + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * L + chunk_start + offs_m, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + h * stride_kh + row0 * stride_kl
    v_base = V + b * stride_vb + h * stride_vh + row0 * stride_vl
    do_rows = DO + b * stride_dob + h * stride_doh + (row0 + offs_m[:, None]) * stride_dol
    kpm_row = KPM + b * stride_kpm_b
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    dq_acc = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)

    hi = chunk_len
    if CAUSAL:
        hi = tl.minimum(chunk_len, m_start + BLOCK_M)
    for n_start in range(0, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < chunk_len
        k = tl.load(
            k_base + offs_n[:, None] * stride_kl + offs_dk[None, :] * stride_kd,
            mask=col_ok[:, None] & (offs_dk[None, :] < DK), other=0.0,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * LOG2E
        keep = _keep_mask(
            offs_m[:, None], offs_n[None, :], chunk_start, chunk_len, L, bh, kpm_row, stride_kpm_l, seed,
            dropout_p, CAUSAL, HAS_KPM, DROPOUT,
        )  # fmt: skip
        p = tl.exp2(tl.where(keep, s, float("-inf")) - lse[:, None])
        dp = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for d_start in range(0, DV, BLOCK_DV):
            offs_d = d_start + offs_dv
            do = tl.load(
                do_rows + offs_d[None, :] * stride_dod,
                mask=row_ok[:, None] & (offs_d[None, :] < DV),
                other=0.0,
            )
            v_t = tl.load(
                v_base + offs_n[None, :] * stride_vl + offs_d[:, None] * stride_vd,
                mask=col_ok[None, :] & (offs_d[:, None] < DV),
                other=0.0,
            )  # Vᵀ tile: [BLOCK_DV, BLOCK_N]
            dp += tl.dot(do, v_t, input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq_acc += tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)

    tl.store(
        DQ_OUT + b * stride_dqb + h * stride_dqh + (row0 + offs_m[:, None]) * stride_dql
        + offs_dk[None, :] * stride_dqd,
        dq_acc.to(DQ_OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_dk[None, :] < DK),
    )  # fmt: skip


@triton.jit
def _dropkey_mask_kernel(OUT, L, H, dropout_p, SEED, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    """OUT[b, h, i, j] = 1 where DropKey drops the logit of query i and key chunk_start(i) + j."""
    i = tl.program_id(0)
    bh = tl.program_id(1)
    chunk_start = (i // CHUNK) * CHUNK
    offs_j = tl.arange(0, BLOCK_C)
    u = _dropkey_uniform(tl.load(SEED), bh, i, chunk_start + offs_j, L)
    tl.store(
        OUT + (bh.to(tl.int64) * L + i) * CHUNK + offs_j, (u < dropout_p).to(tl.int8), mask=offs_j < CHUNK
    )


# ----------------------------------------------------------------------------------------------------------
# Block sizes: autotuned on a GPU, one small configuration under the interpreter
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    """Explicit block sizes for every kernel (bypasses the autotuner; tests and benchmarks)."""

    block_m: int = 16  # query rows per tile
    block_n: int = 16  # key rows per tile
    block_dv: int = 16  # value columns per tile (forward split, backward dP loop and dV split)
    max_fused_dv: int = 128  # backward computes dV inside the dK kernel when dv fits one tile of this width
    num_warps: int = 4
    num_stages: int = 1


_CONFIG_OVERRIDE: KernelConfig | None = None


@contextlib.contextmanager
def kernel_config(config: KernelConfig | None):
    """Run the kernels with fixed block sizes inside the ``with`` block (None: autotuned defaults)."""
    global _CONFIG_OVERRIDE
    previous, _CONFIG_OVERRIDE = _CONFIG_OVERRIDE, config
    try:
        yield
    finally:
        _CONFIG_OVERRIDE = previous


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs every dimension >= 16


# (BLOCK_M, BLOCK_N, warps, stages) per kernel: short lists, since every entry is compiled on first use.
# Chosen from an offline sm_90 compile (registers / spills, no GPU run): the dK/dV kernels want few query
# rows per key block, the dQ kernel few key rows per query block.
_TILES = {
    "fwd": [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3), (32, 32, 4, 2)],
    "dkdv": [(32, 128, 8, 2), (32, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (32, 32, 4, 2)],
    "dq": [(128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3), (32, 32, 4, 2)],
}


def _gpu_configs(kernel: str, with_dv: bool) -> list[triton.Config]:
    if INTERPRET:  # one configuration: the autotuner then runs it without benchmarking
        meta = dict(BLOCK_M=16, BLOCK_N=16) | (dict(BLOCK_DV=16) if with_dv else {})
        return [triton.Config(meta, num_warps=4, num_stages=1)]
    dvs = [64, 128] if with_dv else [None]
    return [
        triton.Config(
            dict(BLOCK_M=m, BLOCK_N=n) | ({} if dv is None else dict(BLOCK_DV=dv)), num_warps=w, num_stages=s
        )
        for m, n, w, s in _TILES[kernel]
        for dv in dvs
    ]


def _prune(configs, named_args, **kwargs):
    """Drop tiles much larger than the chunk or the value width, and (dk = 256) the largest tiles."""
    args = {**named_args, **kwargs}
    c, dk = _pow2(args["CHUNK"]), _pow2(args["DK"])
    dv = _pow2(args["DV"]) if "DV" in args else None
    seen, kept = set(), []
    for cfg in configs:
        meta = dict(cfg.kwargs)
        meta["BLOCK_M"], meta["BLOCK_N"] = min(meta["BLOCK_M"], c), min(meta["BLOCK_N"], c)
        if "BLOCK_DV" in meta and dv is not None:
            meta["BLOCK_DV"] = min(meta["BLOCK_DV"], dv)
        if dk >= 256 and meta["BLOCK_M"] * meta["BLOCK_N"] > 64 * 64:
            continue
        key = (tuple(sorted(meta.items())), cfg.num_warps, cfg.num_stages)
        if key not in seen:
            seen.add(key)
            kept.append(triton.Config(meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return kept or configs[-1:]


_TUNE_KEY = ["CHUNK", "DK", "DV", "CAUSAL", "HAS_KPM", "DROPOUT"]
_fwd_tuned = triton.autotune(
    _gpu_configs("fwd", True), key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune}
)(_fwd_kernel)
_dkdv_tuned = triton.autotune(
    _gpu_configs("dkdv", False), key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune}
)(_bwd_dkdv_kernel)
_dv_tuned = triton.autotune(
    _gpu_configs("dkdv", True), key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune}
)(_bwd_dv_kernel)
_dq_tuned = triton.autotune(
    _gpu_configs("dq", False), key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune}
)(_bwd_dq_kernel)


def _launch(tuned, grid_fn, args: tuple, meta: dict, tuned_keys: tuple[str, ...]) -> None:
    """Run ``tuned`` (an autotuner) or, under :func:`kernel_config`, its kernel with the forced block sizes.
    ``meta`` holds the constexprs the caller fixes; ``tuned_keys`` the ones the autotuner picks.

    ``meta["CHUNK"]`` is the model's chunk_size even for a sequence shorter than one chunk: CHUNK is a
    compile-time constant and an autotune key, so one that followed the length would compile and autotune
    every kernel afresh for each new length (length-bucketed classification batches: a new length almost
    every step). The kernels use CHUNK only as chunk * CHUNK (the chunk's start) and min(CHUNK, L - start),
    which for a single chunk are 0 and L for any CHUNK >= L; the grids use c = min(chunk_size, L)."""
    cfg = _CONFIG_OVERRIDE
    if cfg is None:
        tuned[grid_fn](*args, **meta)
        return
    forced = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_DV": cfg.block_dv}
    forced = {k: forced[k] for k in tuned_keys}
    tuned.fn[grid_fn](*args, **meta, **forced, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ----------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------


def _input_precision(dtype: torch.dtype) -> str:
    """float32 inputs: IEEE products unless torch itself allows TF32 matmuls (then the same trade-off)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # Triton's default; ignored for 16-bit inputs


def _alloc(shape, dtype, device) -> Tensor:
    if DEBUG_NAN_FILL:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, chunk_size: int, key_padding_mask: Tensor | None) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"chunk_attention expects q, k [B, L, h, dk] and v [B, L, h, dv]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"Triton chunk_attention needs q, k, v of one dtype in {SUPPORTED_DTYPES}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(
            f"Triton chunk_attention supports Q/K head width <= {MAX_HEAD_DIM}, got {q.shape[-1]}"
        )
    if key_padding_mask is not None and key_padding_mask.shape != q.shape[:2]:
        raise ValueError(
            f"key_padding_mask must be [B, L] = {tuple(q.shape[:2])}, got {tuple(key_padding_mask.shape)}"
        )


def _mask_args(q: Tensor, key_padding_mask: Tensor | None) -> tuple[Tensor, int, int, bool]:
    if key_padding_mask is None:
        return q, 0, 0, False  # never read: HAS_KPM is a constexpr False
    kpm = key_padding_mask if key_padding_mask.dtype == torch.bool else key_padding_mask != 0
    kpm = kpm.view(torch.uint8)
    return kpm, kpm.stride(0), kpm.stride(1), True


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    seed: Tensor | None,
    chunk_size: int,
    causal: bool,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel. q, k [B, L, h, dk], v [B, L, h, dv], key_padding_mask [B, L] bool or None,
    seed int64 [1] (read only when dropout_p > 0). Returns O [B, L, h, dv] (q.dtype) and the log-sum-exp
    [B, h, L] float32 in log2 units (+inf for a row with no kept key)."""
    _check_inputs(q, k, v, chunk_size, key_padding_mask)
    b, length, h, dk = q.shape
    dv = v.shape[-1]
    o = _alloc((b, length, h, dv), q.dtype, q.device)
    lse = _alloc((b, h, length), torch.float32, q.device)
    if length == 0:
        return o, lse
    c = min(chunk_size, length)
    nc = triton.cdiv(length, c)
    kpm, skb, skl, has_kpm = _mask_args(q, key_padding_mask)
    dropout = dropout_p > 0.0
    grid = lambda meta: (triton.cdiv(c, meta["BLOCK_M"]) * triton.cdiv(dv, meta["BLOCK_DV"]), nc, b * h)
    args = (
        q, k, v, kpm, seed if dropout else None, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), skb, skl,
        length, h, float(dropout_p),
    )  # fmt: skip
    meta = dict(
        CHUNK=chunk_size, DK=dk, DV=dv, CAUSAL=bool(causal), HAS_KPM=has_kpm, DROPOUT=dropout,
        INPUT_PRECISION=_input_precision(q.dtype), BLOCK_DK=_pow2(dk),
    )  # fmt: skip  # CHUNK: see _launch
    _launch(_fwd_tuned, grid, args, meta, ("BLOCK_M", "BLOCK_N", "BLOCK_DV"))
    return o, lse


def attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    key_padding_mask: Tensor | None,
    seed: Tensor | None,
    chunk_size: int,
    causal: bool,
    dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the backward kernels: do, o [B, L, h, dv]; lse [B, h, L] from :func:`attention_forward`.
    Returns dq, dk [B, L, h, dk] and dv [B, L, h, dv] in the input dtype."""
    b, length, h, dk = q.shape
    dv = v.shape[-1]
    dq = _alloc(q.shape, q.dtype, q.device)
    dk_out = _alloc(k.shape, k.dtype, k.device)
    dv_out = _alloc(v.shape, v.dtype, v.device)
    if length == 0:
        return dq, dk_out, dv_out
    c = min(chunk_size, length)
    nc = triton.cdiv(length, c)
    kpm, skb, skl, has_kpm = _mask_args(q, key_padding_mask)
    dropout = dropout_p > 0.0
    seed = seed if dropout else None
    ip = _input_precision(q.dtype)
    cfg = _CONFIG_OVERRIDE or KernelConfig()
    block_dk = _pow2(dk)

    delta = _alloc((b, h, length), torch.float32, q.device)
    block_l, block_pre = 64, min(_pow2(dv), 128)
    _bwd_preprocess_kernel[(triton.cdiv(length, block_l), b * h)](
        o, do, delta, *o.stride(), *do.stride(), length, h, DV=dv, BLOCK_L=block_l, BLOCK_DV=block_pre
    )

    common = dict(
        CHUNK=chunk_size,
        DK=dk,
        DV=dv,
        CAUSAL=bool(causal),
        HAS_KPM=has_kpm,
        DROPOUT=dropout,
        INPUT_PRECISION=ip,
    )  # CHUNK: see _launch
    # dV inside the dK kernel when the whole value width fits one tile; else a dv-tiled kernel of its own,
    # and the dK / dQ kernels accumulate dP over value tiles of a fixed width.
    fuse_dv = _pow2(dv) <= cfg.max_fused_dv
    if fuse_dv:
        block_dv = _pow2(dv)
    else:
        block_dv = min(cfg.block_dv if _CONFIG_OVERRIDE else 64, _pow2(dv))
    key_grid = lambda meta: (triton.cdiv(c, meta["BLOCK_N"]), nc, b * h)
    _launch(
        _dkdv_tuned, key_grid,
        (
            q, k, v, do, kpm, seed, lse, delta, dk_out, dv_out,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk_out.stride(), *dv_out.stride(), skb, skl,
            length, h, float(dropout_p),
        ),
        dict(common, FUSE_DV=fuse_dv, BLOCK_DK=block_dk, BLOCK_DV=block_dv),
        ("BLOCK_M", "BLOCK_N"),
    )  # fmt: skip
    if not fuse_dv:
        dv_grid = lambda meta: (
            triton.cdiv(c, meta["BLOCK_N"]) * triton.cdiv(dv, meta["BLOCK_DV"]),
            nc,
            b * h,
        )
        _launch(
            _dv_tuned, dv_grid,
            (
                q, k, do, kpm, seed, lse, dv_out,
                *q.stride(), *k.stride(), *do.stride(), *dv_out.stride(), skb, skl, length, h, float(dropout_p),
            ),
            dict(common, BLOCK_DK=block_dk),
            ("BLOCK_M", "BLOCK_N", "BLOCK_DV"),
        )  # fmt: skip
    query_grid = lambda meta: (triton.cdiv(c, meta["BLOCK_M"]), nc, b * h)
    _launch(
        _dq_tuned, query_grid,
        (
            q, k, v, do, kpm, seed, lse, delta, dq,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), skb, skl,
            length, h, float(dropout_p),
        ),
        dict(common, BLOCK_DK=block_dk, BLOCK_DV=block_dv),
        ("BLOCK_M", "BLOCK_N"),
    )  # fmt: skip
    return dq, dk_out, dv_out


def dropkey_mask(
    seed: Tensor | int, batch: int, heads: int, length: int, chunk_size: int, dropout_p: float, device=None
) -> Tensor:
    """The DropKey decisions the kernels make for ``seed``: bool [B, h, L, c] with c = min(chunk_size, L),
    True where the logit of query i and key chunk_start(i) + j is dropped (entries past L are meaningless).
    Computed by a tiny Triton kernel with the kernels' own RNG formula."""
    if not isinstance(seed, Tensor):
        seed = torch.tensor([seed], dtype=torch.int64, device=device)
    c = min(chunk_size, length)
    out = torch.zeros(batch, heads, length, c, dtype=torch.int8, device=seed.device)
    if length:
        _dropkey_mask_kernel[(length, batch * heads)](
            out, length, heads, float(dropout_p), seed, CHUNK=c, BLOCK_C=triton.next_power_of_2(c)
        )
    return out.bool()


# ----------------------------------------------------------------------------------------------------------
# Custom ops (torch.compile sees opaque calls with known output shapes) and autograd
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "mega_suite::chunk_attention_fwd",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? seed, int chunk_size, bool causal, "
    "float dropout_p) -> (Tensor, Tensor)",
)
def _fwd_op(q, k, v, key_padding_mask, seed, chunk_size, causal, dropout_p):
    return attention_forward(q, k, v, key_padding_mask, seed, chunk_size, causal, dropout_p)


@_fwd_op.register_fake
def _(q, k, v, key_padding_mask, seed, chunk_size, causal, dropout_p):
    b, length, h, _ = q.shape
    return q.new_empty(b, length, h, v.shape[-1]), q.new_empty(b, h, length, dtype=torch.float32)


@torch.library.custom_op(
    "mega_suite::chunk_attention_bwd",
    mutates_args=(),
    schema="(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? key_padding_mask, "
    "Tensor? seed, int chunk_size, bool causal, float dropout_p) -> (Tensor, Tensor, Tensor)",
)
def _bwd_op(do, q, k, v, o, lse, key_padding_mask, seed, chunk_size, causal, dropout_p):
    return attention_backward(do, q, k, v, o, lse, key_padding_mask, seed, chunk_size, causal, dropout_p)


@_bwd_op.register_fake
def _(do, q, k, v, o, lse, key_padding_mask, seed, chunk_size, causal, dropout_p):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class ChunkAttentionFunction(torch.autograd.Function):
    """O = chunk_attention(q, k, v); saves q, k, v, O and the log-sum-exp, recomputes P in backward."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, seed, chunk_size, causal, dropout_p):
        o, lse = torch.ops.mega_suite.chunk_attention_fwd(
            q, k, v, key_padding_mask, seed, chunk_size, causal, dropout_p
        )
        ctx.save_for_backward(q, k, v, o, lse, key_padding_mask, seed)
        ctx.chunk_size, ctx.causal, ctx.dropout_p = chunk_size, causal, dropout_p
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, key_padding_mask, seed = ctx.saved_tensors
        dq, dk, dv = torch.ops.mega_suite.chunk_attention_bwd(
            do, q, k, v, o, lse, key_padding_mask, seed, ctx.chunk_size, ctx.causal, ctx.dropout_p
        )
        return dq, dk, dv, None, None, None, None, None


def chunk_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    chunk_size: int,
    causal: bool,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    seed: Tensor | int | None = None,
) -> Tensor:
    """Softmax attention inside independent chunks of ``chunk_size`` tokens, fused (Triton), with DropKey.

    Args:
        q, k: [B, L, h, dk], dk <= 256 (RoPE already applied, positions restarting per chunk).
        v: [B, L, h, dv]; dv may differ from dk (any width: it is tiled).
        chunk_size: C; a length that is not a multiple of C leaves the last chunk shorter.
        causal: mask keys after the query inside each chunk.
        key_padding_mask: [B, L] bool, True = padding key.
        dropout_p: DropKey probability: each logit is set to -inf with probability p, no rescaling.
        seed: DropKey seed (int or int64 [1] tensor on q's device); drawn from torch's generator when None.

    Returns:
        [B, L, h, dv] in q's dtype; a query with no kept key outputs zeros (and gets zero gradients).
    """
    if dropout_p > 0.0:
        if seed is None:
            seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q.device)
        elif not isinstance(seed, Tensor):
            seed = torch.tensor([seed], dtype=torch.int64, device=q.device)
    else:
        seed = None
    if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
        key_padding_mask = key_padding_mask != 0
    return ChunkAttentionFunction.apply(
        q, k, v, key_padding_mask, seed, chunk_size, bool(causal), float(dropout_p)
    )
