"""Fused CEMA in Triton (docs/architecture.md#cema): a chunked scan over time, forward and backward.

Per batch row b and channel d, with N complex components, x the input with padded steps zeroed:

    h_t = p x_t + q h_{t-1}                      h_{-1} = h0 (zero unless a state is carried)
    y_t = Re(Σ_n γ_n h_{t,n}) + ω x_t

Complex numbers are (real, imaginary) pairs of float32 registers; the state is float32 whatever x's dtype.
The sequence is cut into chunks of T steps; one program owns (chunk, block of BD channels, batch row) and
runs the recurrence step by step with its [BD, N] state in registers, so every chunk works in parallel.
Inputs arrive as [BD, 16] tiles (16 steps per load, the next tile loaded while the current one is used)
rather than one [BD] row per step, so that memory latency is not paid once per step. Chunks are tied
together by their start states (docs/architecture.md#cema: h ← q^T h + h_local). The powers q^T, q^{T-1} are taken inside the
state-passing kernels by repeated squaring in float64 from the float32 q and rounded once: in float32 the
rounding of arg q would grow l-fold in the phase of q^l, which matters at |q| near 1 (memories of thousands
of steps).

q and γ are read as (re, im) planes with an element stride: 1 for separate planes, 2 for the halves of an
interleaved [R, N, 2] tensor (``view_as_real`` of a complex one, or the coefficient kernel's output), so
neither is copied. Their gradients come back interleaved.

forward
  1. ``_fwd_local_state``   H_c = Σ_j q^{T_c-1-j} p x_j, the chunk's end state from a zero start
  2. ``_fwd_state_passing`` sequential over chunks (16 chunks per load): h_start[c+1] = q^T h_start[c] + H_c,
                            in place; h_last = q^{T_last} h_start[last] + H_last
  3. ``_fwd_output``        each chunk re-runs the recurrence from h_start and writes y

backward, with gy = ∂L/∂y, G_last = ∂L/∂h_last and PyTorch's convention for complex gradients
(G_z = ∂L/∂Re z + i ∂L/∂Im z, i.e. 2 ∂L/∂z̄):
  adjoint    a_t = G_{h_t} = conj(γ) gy_t + conj(q) a_{t+1} (+ G_last at t = L-1), run in reverse time;
             dx_t = Σ_n p_n Re(a_{t,n}) + ω gy_t,  G_p = Σ_t Re(a_t) x_t,  G_h0 = conj(q) a_0
  tangent    D_t = ∂h_t/∂q = h_{t-1} + q D_{t-1}, run forward next to h:
             G_q = conj(γ) Σ_t gy_t conj(D_t) + conj(D_{L-1}) G_last,  G_γ = Σ_t gy_t conj(h_t),
             G_ω = Σ_t gy_t x_t
  (the tangent avoids needing h_{t-1} and a_t at the same step: h cannot be run backwards stably.)
  4. ``_bwd_local_state``   per chunk, from zero: the adjoint at the chunk's first step, and D at its end
  5. ``_bwd_state_passing`` sequential over chunks: the adjoint carried into each chunk from the right
                            (reverse), D at each chunk start (forward: D ← q^T D + T q^{T-1} h_start + D_loc)
  6. ``_bwd_main``          per chunk: the adjoint (dx, G_p) and then h, D (G_q, G_γ, G_ω) from the carries

  7. ``_bwd_reduce``        the per-program partial sums [B·chunks, D, N] summed in a fixed order, with
                            G_q = conj(γ) Σ W_D formed there (no atomics: runs are bitwise reproducible)

Bidirectional CEMA runs the same kernels on the reversed time axis (``REVERSE``) with the second parameter
set and ω = 0, adding into y and dx.

coefficients (``CEMACoefficientsFunction``), from the raw parameters, float64 inside:
  ``_coef_fwd``   p = σ(α), q = (1 - σ(α) σ(δ)) exp(i n θ_d), θ_d = σ(θ) 2π/N, n = 1..N, γ / sqrt(N)
  ``_coef_bwd``   their gradients (see the kernel), θ's summed over n within the program
so the training path runs no complex arithmetic: ``cema_coefficients`` returns complex64 views of the real
outputs, and ``cema_from_parameters`` passes them to the scan without any complex tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.cema.reference import check_cema_args

__all__ = [
    "CEMACoefficientsFunction",
    "CEMAFunction",
    "cema_autograd",
    "cema",
    "cema_coefficients",
    "cema_coefficients_real",
    "cema_from_parameters",
]


# ----------------------------------------------------------------------------------------------- helpers

STEPS = 16  # time steps per loaded tile: one [BD, 16] load, issued a tile ahead of its use


@triton.jit
def _block_offsets(pd, D, N, BD: tl.constexpr, BN: tl.constexpr):
    offs_d = pd * BD + tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    mask_d = offs_d < D
    mask = mask_d[:, None] & (offs_n[None, :] < N)
    coef = offs_d[:, None] * N + offs_n[None, :]
    return offs_d, mask_d, mask, coef


@triton.jit
def _load_steps(
    row_ptr, pad_row, tau, DIR: tl.constexpr, lo, hi, L, D, mask_d,
    REVERSE: tl.constexpr, HAS_PAD: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    """[BD, S] float32 tile whose column j is step tau + DIR * j of the scan, zero outside [lo, hi) and at
    padding. row_ptr: [BD] pointers to time 0 of this batch row's channels. One wide load per S steps
    keeps many bytes in flight; a per-step [BD] load would leave the scan waiting on memory latency."""
    tau_j = tau + DIR * tl.arange(0, S)
    ok = (tau_j >= lo) & (tau_j < hi)
    if REVERSE:
        t_j = L - 1 - tau_j
    else:
        t_j = tau_j
    t_j = t_j.to(tl.int64)
    tile = tl.load(row_ptr[:, None] + t_j[None, :] * D, mask=mask_d[:, None] & ok[None, :], other=0.0)
    tile = tile.to(tl.float32)
    if HAS_PAD:
        pad = tl.load(pad_row + t_j, mask=ok, other=0)
        tile = tl.where(pad[None, :] != 0, 0.0, tile)
    return tile


@triton.jit
def _columns(tile, BD: tl.constexpr):
    """The 16 columns of a [BD, 16] tile as [BD] tensors, in order (a tree of even / odd splits: registers
    cannot be indexed by a loop variable)."""
    e, o = tl.split(tl.reshape(tile, [BD, 8, 2]))  # columns 0 2 .. 14 | 1 3 .. 15
    ee, eo = tl.split(tl.reshape(e, [BD, 4, 2]))  # 0 4 8 12 | 2 6 10 14
    oe, oo = tl.split(tl.reshape(o, [BD, 4, 2]))  # 1 5 9 13 | 3 7 11 15
    c0_8, c4_12 = tl.split(tl.reshape(ee, [BD, 2, 2]))
    c2_10, c6_14 = tl.split(tl.reshape(eo, [BD, 2, 2]))
    c1_9, c5_13 = tl.split(tl.reshape(oe, [BD, 2, 2]))
    c3_11, c7_15 = tl.split(tl.reshape(oo, [BD, 2, 2]))
    c0, c8 = tl.split(c0_8)
    c4, c12 = tl.split(c4_12)
    c2, c10 = tl.split(c2_10)
    c6, c14 = tl.split(c6_14)
    c1, c9 = tl.split(c1_9)
    c5, c13 = tl.split(c5_13)
    c3, c11 = tl.split(c3_11)
    c7, c15 = tl.split(c7_15)
    return c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15


@triton.jit
def _cpow(qr, qi, e):
    """q^e (e >= 0) by repeated squaring in float64 from the float32 q, rounded once to float32: in float32
    the rounding of arg q (~2e-7) would grow e-fold in the phase of q^e; here the error is ~log2(e) 1e-16."""
    br, bi = qr.to(tl.float64), qi.to(tl.float64)
    rr = tl.full(br.shape, 1.0, tl.float64)
    ri = tl.zeros(br.shape, dtype=tl.float64)
    while e > 0:
        odd = (br * 0.0 + (e % 2)) > 0.5
        rr, ri = tl.where(odd, rr * br - ri * bi, rr), tl.where(odd, rr * bi + ri * br, ri)
        br, bi = br * br - bi * bi, 2.0 * br * bi
        e = e // 2
    return rr.to(tl.float32), ri.to(tl.float32)


# ----------------------------------------------------------------------------------------------- forward


@triton.jit
def _fwd_local_state(
    x_ptr, pad_ptr, p_ptr, qr_ptr, qi_ptr, sr_ptr, si_ptr,
    L, D, N, NC, T,
    REVERSE: tl.constexpr, HAS_PAD: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, S: tl.constexpr,
    QS: tl.constexpr,
):  # fmt: skip
    """sr/si[b, c] = Σ_j q^{T_c-1-j} p x_j over chunk c (zero start)."""
    c, pd, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d, mask_d, mask, coef = _block_offsets(pd, D, N, BD, BN)
    b64 = b.to(tl.int64)
    x_row = x_ptr + b64 * L * D + offs_d
    pad_row = pad_ptr + b64 * L
    p = tl.load(p_ptr + coef, mask=mask, other=0.0)
    qr = tl.load(qr_ptr + coef * QS, mask=mask, other=0.0)
    qi = tl.load(qi_ptr + coef * QS, mask=mask, other=0.0)
    hr = tl.zeros([BD, BN], dtype=tl.float32)
    hi = tl.zeros([BD, BN], dtype=tl.float32)
    tau0 = c * T
    tc = tl.minimum(T, L - tau0)
    x_next = _load_steps(x_row, pad_row, tau0, 1, tau0, tau0 + tc, L, D, mask_d, REVERSE, HAS_PAD, S)
    for blk in range(tl.cdiv(tc, S)):
        xs = _columns(x_next, BD)
        x_next = _load_steps(
            x_row, pad_row, tau0 + (blk + 1) * S, 1, tau0, tau0 + tc, L, D, mask_d, REVERSE, HAS_PAD, S
        )
        for j in tl.static_range(S):
            if blk * S + j < tc:
                x = xs[j][:, None]
                hr, hi = qr * hr - qi * hi + p * x, qr * hi + qi * hr
    st = (b64 * NC + c) * D * N + coef
    tl.store(sr_ptr + st, hr, mask=mask)
    tl.store(si_ptr + st, hi, mask=mask)


@triton.jit
def _load_chunks(ptr, c, DIR: tl.constexpr, NC, DN, mask, S: tl.constexpr):
    """[BLOCK, S] tile of a [.., NC, DN] plane: column j is chunk c + DIR * j (zero outside [0, NC)).
    ptr: [BLOCK] pointers to chunk 0."""
    cj = c + DIR * tl.arange(0, S)
    ok = (cj >= 0) & (cj < NC)
    return tl.load(ptr[:, None] + cj.to(tl.int64)[None, :] * DN, mask=mask[:, None] & ok[None, :], other=0.0)


@triton.jit
def _fwd_state_passing(
    sr_ptr, si_ptr, h0r_ptr, h0i_ptr, hlr_ptr, hli_ptr, qr_ptr, qi_ptr,
    L, DN, NC, T,
    HAS_H0: tl.constexpr, BLOCK: tl.constexpr, S: tl.constexpr, QS: tl.constexpr,
):  # fmt: skip
    """In place: chunk end states from zero -> chunk start states; h_last out. Flat over (d, n)."""
    pid, b = tl.program_id(0), tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < DN
    qr = tl.load(qr_ptr + offs * QS, mask=mask, other=0.0)
    qi = tl.load(qi_ptr + offs * QS, mask=mask, other=0.0)
    qtr, qti = _cpow(qr, qi, T)  # q^T
    qlr, qli = _cpow(qr, qi, L - (NC - 1) * T)  # q^{T_last}
    if HAS_H0:
        hr = tl.load(h0r_ptr + b * DN + offs, mask=mask, other=0.0)
        hi = tl.load(h0i_ptr + b * DN + offs, mask=mask, other=0.0)
    else:
        hr = tl.zeros([BLOCK], dtype=tl.float32)
        hi = tl.zeros([BLOCK], dtype=tl.float32)
    base = b.to(tl.int64) * NC * DN + offs
    next_r = _load_chunks(sr_ptr + base, 0, 1, NC, DN, mask, S)
    next_i = _load_chunks(si_ptr + base, 0, 1, NC, DN, mask, S)
    for blk in range(tl.cdiv(NC, S)):
        loc_r = _columns(next_r, BLOCK)
        loc_i = _columns(next_i, BLOCK)
        next_r = _load_chunks(sr_ptr + base, (blk + 1) * S, 1, NC, DN, mask, S)
        next_i = _load_chunks(si_ptr + base, (blk + 1) * S, 1, NC, DN, mask, S)
        for j in tl.static_range(S):
            c = blk * S + j
            if c < NC:
                tl.store(sr_ptr + base + c * DN, hr, mask=mask)
                tl.store(si_ptr + base + c * DN, hi, mask=mask)
                last = c == NC - 1
                pr = tl.where(last, qlr, qtr)
                pi = tl.where(last, qli, qti)
                hr, hi = pr * hr - pi * hi + loc_r[j], pr * hi + pi * hr + loc_i[j]
    tl.store(hlr_ptr + b * DN + offs, hr, mask=mask)
    tl.store(hli_ptr + b * DN + offs, hi, mask=mask)


@triton.jit
def _fwd_output(
    x_ptr, pad_ptr, y_ptr, p_ptr, qr_ptr, qi_ptr, gr_ptr, gi_ptr, om_ptr, sr_ptr, si_ptr,
    L, D, N, NC, T,
    REVERSE: tl.constexpr, HAS_PAD: tl.constexpr, ACCUMULATE: tl.constexpr,
    BD: tl.constexpr, BN: tl.constexpr, S: tl.constexpr, QS: tl.constexpr, GS: tl.constexpr,
):  # fmt: skip
    """y_t = Re(Σ_n γ h_t) + ω x_t over chunk c, the recurrence started from h_start[c]."""
    c, pd, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d, mask_d, mask, coef = _block_offsets(pd, D, N, BD, BN)
    b64 = b.to(tl.int64)
    x_row = x_ptr + b64 * L * D + offs_d
    pad_row = pad_ptr + b64 * L
    y_row = y_ptr + b64 * L * D + offs_d
    p = tl.load(p_ptr + coef, mask=mask, other=0.0)
    qr = tl.load(qr_ptr + coef * QS, mask=mask, other=0.0)
    qi = tl.load(qi_ptr + coef * QS, mask=mask, other=0.0)
    gr = tl.load(gr_ptr + coef * GS, mask=mask, other=0.0)
    gi = tl.load(gi_ptr + coef * GS, mask=mask, other=0.0)
    om = tl.load(om_ptr + offs_d, mask=mask_d, other=0.0)
    st = (b64 * NC + c) * D * N + coef
    hr = tl.load(sr_ptr + st, mask=mask, other=0.0)
    hi = tl.load(si_ptr + st, mask=mask, other=0.0)
    tau0 = c * T
    tc = tl.minimum(T, L - tau0)
    x_next = _load_steps(x_row, pad_row, tau0, 1, tau0, tau0 + tc, L, D, mask_d, REVERSE, HAS_PAD, S)
    for blk in range(tl.cdiv(tc, S)):
        xs = _columns(x_next, BD)
        x_next = _load_steps(
            x_row, pad_row, tau0 + (blk + 1) * S, 1, tau0, tau0 + tc, L, D, mask_d, REVERSE, HAS_PAD, S
        )
        for j in tl.static_range(S):
            if blk * S + j < tc:
                x = xs[j]
                hr, hi = qr * hr - qi * hi + p * x[:, None], qr * hi + qi * hr
                y = tl.sum(gr * hr - gi * hi, axis=1) + om * x
                t = tau0 + blk * S + j
                if REVERSE:
                    t = L - 1 - t
                if ACCUMULATE:
                    y += tl.load(y_row + t * D, mask=mask_d, other=0.0).to(tl.float32)
                tl.store(y_row + t * D, y.to(y_ptr.dtype.element_ty), mask=mask_d)


# ---------------------------------------------------------------------------------------------- backward


@triton.jit
def _bwd_local_state(
    x_ptr, pad_ptr, gy_ptr, p_ptr, qr_ptr, qi_ptr, gr_ptr, gi_ptr, ar_ptr, ai_ptr, dr_ptr, di_ptr,
    L, D, N, NC, T,
    REVERSE: tl.constexpr, HAS_PAD: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, S: tl.constexpr,
    QS: tl.constexpr, GS: tl.constexpr,
):  # fmt: skip
    """Per chunk from zero: the adjoint at its first step (ar/ai) and the q-tangent D at its end (dr/di)."""
    c, pd, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d, mask_d, mask, coef = _block_offsets(pd, D, N, BD, BN)
    b64 = b.to(tl.int64)
    x_row = x_ptr + b64 * L * D + offs_d
    pad_row = pad_ptr + b64 * L
    gy_row = gy_ptr + b64 * L * D + offs_d
    p = tl.load(p_ptr + coef, mask=mask, other=0.0)
    qr = tl.load(qr_ptr + coef * QS, mask=mask, other=0.0)
    qi = tl.load(qi_ptr + coef * QS, mask=mask, other=0.0)
    gr = tl.load(gr_ptr + coef * GS, mask=mask, other=0.0)
    gi = tl.load(gi_ptr + coef * GS, mask=mask, other=0.0)
    tau0 = c * T
    tc = tl.minimum(T, L - tau0)
    tau_end = tau0 + tc - 1
    # reverse: a_i = conj(γ) gy_i + s, s = conj(q) a_{i+1}
    ar = tl.zeros([BD, BN], dtype=tl.float32)
    ai = tl.zeros([BD, BN], dtype=tl.float32)
    sr = tl.zeros([BD, BN], dtype=tl.float32)
    si = tl.zeros([BD, BN], dtype=tl.float32)
    g_next = _load_steps(gy_row, pad_row, tau_end, -1, tau0, tau0 + tc, L, D, mask_d, REVERSE, False, S)
    for blk in range(tl.cdiv(tc, S)):
        gs = _columns(g_next, BD)
        g_next = _load_steps(
            gy_row, pad_row, tau_end - (blk + 1) * S, -1, tau0, tau0 + tc, L, D, mask_d, REVERSE, False, S
        )
        for j in tl.static_range(S):
            if blk * S + j < tc:
                g = gs[j][:, None]
                ar, ai = gr * g + sr, si - gi * g
                sr, si = qr * ar + qi * ai, qr * ai - qi * ar
    st = (b64 * NC + c) * D * N + coef
    tl.store(ar_ptr + st, ar, mask=mask)
    tl.store(ai_ptr + st, ai, mask=mask)
    # forward: D_i = h_{i-1} + q D_{i-1}, h_i = q h_{i-1} + p x_i
    hr = tl.zeros([BD, BN], dtype=tl.float32)
    hi = tl.zeros([BD, BN], dtype=tl.float32)
    dr = tl.zeros([BD, BN], dtype=tl.float32)
    di = tl.zeros([BD, BN], dtype=tl.float32)
    x_next = _load_steps(x_row, pad_row, tau0, 1, tau0, tau0 + tc, L, D, mask_d, REVERSE, HAS_PAD, S)
    for blk in range(tl.cdiv(tc, S)):
        xs = _columns(x_next, BD)
        x_next = _load_steps(
            x_row, pad_row, tau0 + (blk + 1) * S, 1, tau0, tau0 + tc, L, D, mask_d, REVERSE, HAS_PAD, S
        )
        for j in tl.static_range(S):
            if blk * S + j < tc:
                x = xs[j][:, None]
                dr, di = hr + qr * dr - qi * di, hi + qr * di + qi * dr
                hr, hi = qr * hr - qi * hi + p * x, qr * hi + qi * hr
    tl.store(dr_ptr + st, dr, mask=mask)
    tl.store(di_ptr + st, di, mask=mask)


@triton.jit
def _bwd_state_passing(
    ar_ptr, ai_ptr, dr_ptr, di_ptr, sr_ptr, si_ptr, ghr_ptr, ghi_ptr, qr_ptr, qi_ptr,
    gh0r_ptr, gh0i_ptr, gqr_ptr, gqi_ptr,
    L, DN, NC, T,
    HAS_GLAST: tl.constexpr, BLOCK: tl.constexpr, S: tl.constexpr, QS: tl.constexpr,
):  # fmt: skip
    """In place: local adjoints -> adjoint carried into each chunk from the right (ar/ai), local tangents
    -> tangent at each chunk start (dr/di). Out: G_h0 and conj(D_{L-1}) G_last per batch row."""
    pid, b = tl.program_id(0), tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < DN
    qr = tl.load(qr_ptr + offs * QS, mask=mask, other=0.0)
    qi = tl.load(qi_ptr + offs * QS, mask=mask, other=0.0)
    t_last = L - (NC - 1) * T
    qtr, qti = _cpow(qr, qi, T)  # q^T
    qt1r, qt1i = _cpow(qr, qi, T - 1)  # q^{T-1}
    qlr, qli = _cpow(qr, qi, t_last)  # q^{T_last}
    ql1r, ql1i = _cpow(qr, qi, t_last - 1)  # q^{T_last-1}
    if HAS_GLAST:
        glr = tl.load(ghr_ptr + b * DN + offs, mask=mask, other=0.0)
        gli = tl.load(ghi_ptr + b * DN + offs, mask=mask, other=0.0)
    else:
        glr = tl.zeros([BLOCK], dtype=tl.float32)
        gli = tl.zeros([BLOCK], dtype=tl.float32)
    base = b.to(tl.int64) * NC * DN + offs

    # adjoint, right to left: a_first = a_loc + conj(q)^{T_c-1} s, then s = conj(q) a_first
    sr, si = glr, gli
    next_r = _load_chunks(ar_ptr + base, NC - 1, -1, NC, DN, mask, S)
    next_i = _load_chunks(ai_ptr + base, NC - 1, -1, NC, DN, mask, S)
    for blk in range(tl.cdiv(NC, S)):
        loc_r = _columns(next_r, BLOCK)
        loc_i = _columns(next_i, BLOCK)
        next_r = _load_chunks(ar_ptr + base, NC - 1 - (blk + 1) * S, -1, NC, DN, mask, S)
        next_i = _load_chunks(ai_ptr + base, NC - 1 - (blk + 1) * S, -1, NC, DN, mask, S)
        for j in tl.static_range(S):
            c = NC - 1 - blk * S - j
            if c >= 0:
                tl.store(ar_ptr + base + c * DN, sr, mask=mask)
                tl.store(ai_ptr + base + c * DN, si, mask=mask)
                last = c == NC - 1
                pr = tl.where(last, ql1r, qt1r)
                pi = tl.where(last, ql1i, qt1i)
                fr, fi = loc_r[j] + pr * sr + pi * si, loc_i[j] + pr * si - pi * sr
                sr, si = qr * fr + qi * fi, qr * fi - qi * fr
    tl.store(gh0r_ptr + b * DN + offs, sr, mask=mask)
    tl.store(gh0i_ptr + b * DN + offs, si, mask=mask)

    # tangent, left to right: D_end = q^{T_c} D_start + T_c q^{T_c-1} h_start + D_loc
    tr = tl.zeros([BLOCK], dtype=tl.float32)
    ti = tl.zeros([BLOCK], dtype=tl.float32)
    next_dr = _load_chunks(dr_ptr + base, 0, 1, NC, DN, mask, S)
    next_di = _load_chunks(di_ptr + base, 0, 1, NC, DN, mask, S)
    next_hr = _load_chunks(sr_ptr + base, 0, 1, NC, DN, mask, S)
    next_hi = _load_chunks(si_ptr + base, 0, 1, NC, DN, mask, S)
    for blk in range(tl.cdiv(NC, S)):
        loc_r = _columns(next_dr, BLOCK)
        loc_i = _columns(next_di, BLOCK)
        h_r = _columns(next_hr, BLOCK)
        h_i = _columns(next_hi, BLOCK)
        next_dr = _load_chunks(dr_ptr + base, (blk + 1) * S, 1, NC, DN, mask, S)
        next_di = _load_chunks(di_ptr + base, (blk + 1) * S, 1, NC, DN, mask, S)
        next_hr = _load_chunks(sr_ptr + base, (blk + 1) * S, 1, NC, DN, mask, S)
        next_hi = _load_chunks(si_ptr + base, (blk + 1) * S, 1, NC, DN, mask, S)
        for j in tl.static_range(S):
            c = blk * S + j
            if c < NC:
                tl.store(dr_ptr + base + c * DN, tr, mask=mask)
                tl.store(di_ptr + base + c * DN, ti, mask=mask)
                last = c == NC - 1
                pr = tl.where(last, qlr, qtr)
                pi = tl.where(last, qli, qti)
                steps = tl.where(last, t_last, T).to(tl.float32)
                p1r = tl.where(last, ql1r, qt1r) * steps
                p1i = tl.where(last, ql1i, qt1i) * steps
                tr, ti = (
                    pr * tr - pi * ti + p1r * h_r[j] - p1i * h_i[j] + loc_r[j],
                    pr * ti + pi * tr + p1r * h_i[j] + p1i * h_r[j] + loc_i[j],
                )
    # conj(D_{L-1}) G_last: h_last's cotangent reaching q through every step
    tl.store(gqr_ptr + b * DN + offs, tr * glr + ti * gli, mask=mask)
    tl.store(gqi_ptr + b * DN + offs, tr * gli - ti * glr, mask=mask)


@triton.jit
def _bwd_main(
    x_ptr, pad_ptr, gy_ptr, dx_ptr, p_ptr, qr_ptr, qi_ptr, gr_ptr, gi_ptr, om_ptr,
    car_r_ptr, car_i_ptr, sr_ptr, si_ptr, ds_r_ptr, ds_i_ptr,
    gp_ptr, whr_ptr, whi_ptr, wdr_ptr, wdi_ptr, gom_ptr,
    L, D, N, NC, T,
    REVERSE: tl.constexpr, HAS_PAD: tl.constexpr, ACCUMULATE: tl.constexpr,
    BD: tl.constexpr, BN: tl.constexpr, S: tl.constexpr, QS: tl.constexpr, GS: tl.constexpr,
):  # fmt: skip
    """Per chunk: dx and G_p from the adjoint (reverse), then the partial sums of Σ gy conj(h),
    Σ gy conj(D) and Σ gy x from the recurrence and its q-tangent (forward)."""
    c, pd, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d, mask_d, mask, coef = _block_offsets(pd, D, N, BD, BN)
    b64 = b.to(tl.int64)
    x_row = x_ptr + b64 * L * D + offs_d
    pad_row = pad_ptr + b64 * L
    gy_row = gy_ptr + b64 * L * D + offs_d
    dx_row = dx_ptr + b64 * L * D + offs_d
    p = tl.load(p_ptr + coef, mask=mask, other=0.0)
    qr = tl.load(qr_ptr + coef * QS, mask=mask, other=0.0)
    qi = tl.load(qi_ptr + coef * QS, mask=mask, other=0.0)
    gr = tl.load(gr_ptr + coef * GS, mask=mask, other=0.0)
    gi = tl.load(gi_ptr + coef * GS, mask=mask, other=0.0)
    om = tl.load(om_ptr + offs_d, mask=mask_d, other=0.0)
    st = (b64 * NC + c) * D * N + coef
    tau0 = c * T
    tc = tl.minimum(T, L - tau0)
    tau_end = tau0 + tc - 1

    # reverse: a_i = conj(γ) gy_i + s (s: the adjoint carried in from the right, then conj(q) a_{i+1})
    sr = tl.load(car_r_ptr + st, mask=mask, other=0.0)
    si = tl.load(car_i_ptr + st, mask=mask, other=0.0)
    gp = tl.zeros([BD, BN], dtype=tl.float32)
    g_next = _load_steps(gy_row, pad_row, tau_end, -1, tau0, tau0 + tc, L, D, mask_d, REVERSE, False, S)
    x_next = _load_steps(x_row, pad_row, tau_end, -1, tau0, tau0 + tc, L, D, mask_d, REVERSE, HAS_PAD, S)
    for blk in range(tl.cdiv(tc, S)):
        gs = _columns(g_next, BD)
        xs = _columns(x_next, BD)
        tau = tau_end - (blk + 1) * S
        g_next = _load_steps(gy_row, pad_row, tau, -1, tau0, tau0 + tc, L, D, mask_d, REVERSE, False, S)
        x_next = _load_steps(x_row, pad_row, tau, -1, tau0, tau0 + tc, L, D, mask_d, REVERSE, HAS_PAD, S)
        for j in tl.static_range(S):
            if blk * S + j < tc:
                g = gs[j]
                ar, ai = gr * g[:, None] + sr, si - gi * g[:, None]
                dx = tl.sum(p * ar, axis=1) + om * g
                t = tau_end - blk * S - j
                if REVERSE:
                    t = L - 1 - t
                if HAS_PAD:
                    dx = tl.where(tl.load(pad_row + t) != 0, 0.0, dx)
                if ACCUMULATE:
                    dx += tl.load(dx_row + t * D, mask=mask_d, other=0.0).to(tl.float32)
                tl.store(dx_row + t * D, dx.to(dx_ptr.dtype.element_ty), mask=mask_d)
                gp += ar * xs[j][:, None]
                sr, si = qr * ar + qi * ai, qr * ai - qi * ar
    tl.store(gp_ptr + st, gp, mask=mask)

    # forward: h and its q-tangent D from the chunk's start values
    hr = tl.load(sr_ptr + st, mask=mask, other=0.0)
    hi = tl.load(si_ptr + st, mask=mask, other=0.0)
    dr = tl.load(ds_r_ptr + st, mask=mask, other=0.0)
    di = tl.load(ds_i_ptr + st, mask=mask, other=0.0)
    whr = tl.zeros([BD, BN], dtype=tl.float32)
    whi = tl.zeros([BD, BN], dtype=tl.float32)
    wdr = tl.zeros([BD, BN], dtype=tl.float32)
    wdi = tl.zeros([BD, BN], dtype=tl.float32)
    gom = tl.zeros([BD], dtype=tl.float32)
    g_next = _load_steps(gy_row, pad_row, tau0, 1, tau0, tau0 + tc, L, D, mask_d, REVERSE, False, S)
    x_next = _load_steps(x_row, pad_row, tau0, 1, tau0, tau0 + tc, L, D, mask_d, REVERSE, HAS_PAD, S)
    for blk in range(tl.cdiv(tc, S)):
        gs = _columns(g_next, BD)
        xs = _columns(x_next, BD)
        tau = tau0 + (blk + 1) * S
        g_next = _load_steps(gy_row, pad_row, tau, 1, tau0, tau0 + tc, L, D, mask_d, REVERSE, False, S)
        x_next = _load_steps(x_row, pad_row, tau, 1, tau0, tau0 + tc, L, D, mask_d, REVERSE, HAS_PAD, S)
        for j in tl.static_range(S):
            if blk * S + j < tc:
                g = gs[j]
                x = xs[j]
                dr, di = hr + qr * dr - qi * di, hi + qr * di + qi * dr
                hr, hi = qr * hr - qi * hi + p * x[:, None], qr * hi + qi * hr
                g2 = g[:, None]
                whr += g2 * hr
                whi -= g2 * hi
                wdr += g2 * dr
                wdi -= g2 * di
                gom += g * x
    tl.store(whr_ptr + st, whr, mask=mask)
    tl.store(whi_ptr + st, whi, mask=mask)
    tl.store(wdr_ptr + st, wdr, mask=mask)
    tl.store(wdi_ptr + st, wdi, mask=mask)
    tl.store(gom_ptr + (b64 * NC + c) * D + offs_d, gom, mask=mask_d)


@triton.jit
def _bwd_reduce(
    part_ptr, gom_part_ptr, gql_ptr, gr_ptr, gi_ptr, gp_ptr, gq_ptr, gg_ptr, gom_ptr,
    DN, D, ROWS, PLANE, B, OUT0,
    HAS_GLAST: tl.constexpr, OMEGA: tl.constexpr, GS: tl.constexpr, RR: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Sums over the (batch, chunk) partials [5, ROWS, D, N], RR rows at a time in a fixed order (no atomics):
    G_p, G_γ = Σ W_h and G_q = conj(γ) Σ W_D (+ Σ_b conj(D_{L-1}) G_last), written from flat element OUT0 on
    (G_q, G_γ interleaved re / im). Programs after the first ceil(DN / BLOCK): G_ω = Σ of its partials
    [ROWS, D]."""
    pid = tl.program_id(0)
    nflat = tl.cdiv(DN, BLOCK)
    rows = tl.arange(0, RR)
    if pid < nflat:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < DN
        acc_p = tl.zeros([BLOCK], dtype=tl.float32)
        acc_hr = tl.zeros([BLOCK], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK], dtype=tl.float32)
        acc_dr = tl.zeros([BLOCK], dtype=tl.float32)
        acc_di = tl.zeros([BLOCK], dtype=tl.float32)
        for r0 in range(0, ROWS, RR):
            m2 = ((r0 + rows) < ROWS)[:, None] & mask[None, :]
            ptr = part_ptr + (r0 + rows)[:, None].to(tl.int64) * DN + offs[None, :]
            acc_p += tl.sum(tl.load(ptr, mask=m2, other=0.0), axis=0)
            acc_hr += tl.sum(tl.load(ptr + PLANE, mask=m2, other=0.0), axis=0)
            acc_hi += tl.sum(tl.load(ptr + 2 * PLANE, mask=m2, other=0.0), axis=0)
            acc_dr += tl.sum(tl.load(ptr + 3 * PLANE, mask=m2, other=0.0), axis=0)
            acc_di += tl.sum(tl.load(ptr + 4 * PLANE, mask=m2, other=0.0), axis=0)
        gr = tl.load(gr_ptr + offs * GS, mask=mask, other=0.0)
        gi = tl.load(gi_ptr + offs * GS, mask=mask, other=0.0)
        gqr = gr * acc_dr + gi * acc_di
        gqi = gr * acc_di - gi * acc_dr
        if HAS_GLAST:
            for b in range(B):
                gqr += tl.load(gql_ptr + b * DN + offs, mask=mask, other=0.0)
                gqi += tl.load(gql_ptr + (B + b) * DN + offs, mask=mask, other=0.0)
        out = OUT0 + offs
        tl.store(gp_ptr + out, acc_p, mask=mask)
        tl.store(gq_ptr + 2 * out, gqr, mask=mask)
        tl.store(gq_ptr + 2 * out + 1, gqi, mask=mask)
        tl.store(gg_ptr + 2 * out, acc_hr, mask=mask)
        tl.store(gg_ptr + 2 * out + 1, acc_hi, mask=mask)
    elif OMEGA:
        cols = (pid - nflat) * BLOCK + tl.arange(0, BLOCK)
        c_ok = cols < D
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r0 in range(0, ROWS, RR):
            m2 = ((r0 + rows) < ROWS)[:, None] & c_ok[None, :]
            ptr = gom_part_ptr + (r0 + rows)[:, None].to(tl.int64) * D + cols[None, :]
            acc += tl.sum(tl.load(ptr, mask=m2, other=0.0), axis=0)
        tl.store(gom_ptr + cols, acc, mask=c_ok)


# ------------------------------------------------------------------------------------------- coefficients


@triton.jit
def _coef_index(R, N, BR: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BN)
    mask = (rows < R)[:, None] & (cols < N)[None, :]
    return rows, cols, mask, rows[:, None] * N + cols[None, :]


@triton.jit
def _coef_common(a_ptr, d_ptr, t_ptr, rows, cols, mask, idx, R, N):
    """float64: σ(α), σ(δ), σ(θ) per row, the phase n θ_d (n = 1..N) and |q| = 1 - σ(α) σ(δ)."""
    a = tl.sigmoid(tl.load(a_ptr + idx, mask=mask, other=0.0).to(tl.float64))
    dl = tl.sigmoid(tl.load(d_ptr + idx, mask=mask, other=0.0).to(tl.float64))
    th = tl.sigmoid(tl.load(t_ptr + rows, mask=rows < R, other=0.0).to(tl.float64))
    step = tl.full([], 6.283185307179586, tl.float64) / N
    phase = (cols + 1).to(tl.float64)[None, :] * (th * step)[:, None]
    return a, dl, th, step, phase, 1.0 - a * dl


@triton.jit
def _coef_fwd(
    a_ptr, d_ptr, t_ptr, g_ptr, p_ptr, q_ptr, go_ptr, R, N, inv_sqrt_n,
    BR: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """p = σ(α); q = (1 - σ(α) σ(δ)) exp(i n θ_d), θ_d = σ(θ) 2π/N; γ / sqrt(N) (q, γ interleaved re / im).
    In float64, rounded once to float32."""
    rows, cols, mask, idx = _coef_index(R, N, BR, BN)
    a, _, _, _, phase, mag = _coef_common(a_ptr, d_ptr, t_ptr, rows, cols, mask, idx, R, N)
    tl.store(p_ptr + idx, a.to(tl.float32), mask=mask)
    tl.store(q_ptr + 2 * idx, (mag * tl.cos(phase)).to(tl.float32), mask=mask)
    tl.store(q_ptr + 2 * idx + 1, (mag * tl.sin(phase)).to(tl.float32), mask=mask)
    g_re = tl.load(g_ptr + 2 * idx, mask=mask, other=0.0).to(tl.float32)
    g_im = tl.load(g_ptr + 2 * idx + 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(go_ptr + 2 * idx, g_re * inv_sqrt_n, mask=mask)
    tl.store(go_ptr + 2 * idx + 1, g_im * inv_sqrt_n, mask=mask)


@triton.jit
def _coef_bwd(
    a_ptr, d_ptr, t_ptr, gp_ptr, gq_ptr, gg_ptr, da_ptr, dd_ptr, dt_ptr, dg_ptr, R, N, inv_sqrt_n,
    BR: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """With G_q = ∂L/∂Re q + i ∂L/∂Im q: G_|q| = Re(G_q e^{-iφ}), G_φ = |q| Im(G_q e^{-iφ});
    dα = σ'(α) (G_p - G_|q| σ(δ)), dδ = -G_|q| σ(α) σ'(δ), dθ = σ'(θ) 2π/N Σ_n n G_φn, dγ = G_γ / sqrt(N)."""
    rows, cols, mask, idx = _coef_index(R, N, BR, BN)
    a, dl, th, step, phase, mag = _coef_common(a_ptr, d_ptr, t_ptr, rows, cols, mask, idx, R, N)
    gp = tl.load(gp_ptr + idx, mask=mask, other=0.0).to(tl.float64)
    gqr = tl.load(gq_ptr + 2 * idx, mask=mask, other=0.0).to(tl.float64)
    gqi = tl.load(gq_ptr + 2 * idx + 1, mask=mask, other=0.0).to(tl.float64)
    c, s = tl.cos(phase), tl.sin(phase)
    g_mag = gqr * c + gqi * s
    g_phase = mag * (gqi * c - gqr * s)
    tl.store(da_ptr + idx, (a * (1.0 - a) * (gp - g_mag * dl)).to(tl.float32), mask=mask)
    tl.store(dd_ptr + idx, (-g_mag * a * dl * (1.0 - dl)).to(tl.float32), mask=mask)
    weighted = tl.where(mask, g_phase * (cols + 1).to(tl.float64)[None, :], 0.0)
    d_theta = tl.sum(weighted, axis=1) * step * th * (1.0 - th)
    tl.store(dt_ptr + rows, d_theta.to(tl.float32), mask=rows < R)
    ggr = tl.load(gg_ptr + 2 * idx, mask=mask, other=0.0)
    ggi = tl.load(gg_ptr + 2 * idx + 1, mask=mask, other=0.0)
    tl.store(dg_ptr + 2 * idx, ggr * inv_sqrt_n, mask=mask)
    tl.store(dg_ptr + 2 * idx + 1, ggi * inv_sqrt_n, mask=mask)


# --------------------------------------------------------------------------------------------- launchers


def _pair(re: Tensor, im: Tensor) -> tuple[Tensor, Tensor, int]:
    """(re, im, stride): float32 [R, N] planes, either contiguous (stride 1) or the two halves of an
    interleaved [R, N, 2] tensor (stride 2, e.g. ``view_as_real`` of a complex tensor), read in place."""
    re, im = re.detach(), im.detach()
    if re.dtype == im.dtype == torch.float32 and re.dim() == 2:
        n = re.shape[1]
        for stride in (1, 2):
            if re.stride() == (n * stride, stride) and im.stride() == re.stride():
                return re, im, stride
    return re.to(torch.float32).contiguous(), im.to(torch.float32).contiguous(), 1


class _Coefs:
    """One direction's coefficients: p [D, N] and ω [D] contiguous float32; q and γ as (re, im) planes with
    their element stride (1, or 2 when interleaved)."""

    def __init__(self, p: Tensor, qr: Tensor, qi: Tensor, gr: Tensor, gi: Tensor, omega: Tensor):
        f = lambda t: t.detach().to(torch.float32).contiguous()
        self.p, self.omega = f(p), f(omega)
        self.qr, self.qi, self.qs = _pair(qr, qi)
        self.gr, self.gi, self.gs = _pair(gr, gi)


def _config(batch: int, length: int, dim: int, ndim: int, chunk: int | None):
    """Block sizes: BD channels x BN components per program; T steps per chunk."""
    bn = triton.next_power_of_2(ndim)
    bd = max(1, min(triton.next_power_of_2(dim), max(1, 512 // bn)))
    if chunk is None:
        # enough programs to fill the GPU (about 4096), chunks as long as that allows (fewer partials)
        blocks = batch * triton.cdiv(dim, bd)
        chunk = triton.next_power_of_2(triton.cdiv(length * blocks, 4096))
        chunk = max(32, min(256, chunk))
    chunk = max(1, min(chunk, length))
    warps = 4 if bd * bn >= 512 else (2 if bd * bn >= 128 else 1)
    return bd, bn, chunk, warps


def _state_block(dn: int) -> int:
    # [BLOCK, 16] tiles of chunk states, double-buffered: 64 keeps them in registers with 4 warps
    return min(64, triton.next_power_of_2(dn))


def _reduce_block(dn: int) -> tuple[int, int]:
    """(elements per program, partial rows per step) of the sum over (batch, chunk) partials."""
    block = min(128, triton.next_power_of_2(dn))
    return block, max(1, 1024 // block)


def _forward(
    x: Tensor, pad: Tensor | None, cf: _Coefs, h0r, h0i, reverse: bool, chunk, y: Tensor, accumulate: bool
):
    """One direction: writes (or adds into) y; returns the chunk start states [2, B, NC, D, N] and h_last."""
    b, length, d = x.shape
    n = cf.p.shape[1]
    bd, bn, t, warps = chunk
    nc = triton.cdiv(length, t)
    states = torch.empty(2, b, nc, d, n, device=x.device, dtype=torch.float32)
    h_last = tuple(torch.empty(b, d, n, device=x.device, dtype=torch.float32) for _ in range(2))
    grid = (nc, triton.cdiv(d, bd), b)
    pad_arg = pad if pad is not None else x
    _fwd_local_state[grid](
        x, pad_arg, cf.p, cf.qr, cf.qi, states[0], states[1], length, d, n, nc, t,
        REVERSE=reverse, HAS_PAD=pad is not None, BD=bd, BN=bn, S=STEPS, QS=cf.qs, num_warps=warps,
    )  # fmt: skip
    block = _state_block(d * n)
    has_h0 = h0r is not None
    _fwd_state_passing[(triton.cdiv(d * n, block), b)](
        states[0], states[1], h0r if has_h0 else states[0], h0i if has_h0 else states[1],
        h_last[0], h_last[1], cf.qr, cf.qi, length, d * n, nc, t,
        HAS_H0=has_h0, BLOCK=block, S=STEPS, QS=cf.qs, num_warps=4,
    )  # fmt: skip
    _fwd_output[grid](
        x, pad_arg, y, cf.p, cf.qr, cf.qi, cf.gr, cf.gi, cf.omega, states[0], states[1], length, d, n, nc, t,
        REVERSE=reverse, HAS_PAD=pad is not None, ACCUMULATE=accumulate, BD=bd, BN=bn, S=STEPS, QS=cf.qs,
        GS=cf.gs, num_warps=warps,
    )  # fmt: skip
    return states, h_last


def _backward(
    x: Tensor, pad: Tensor | None, gy: Tensor, cf: _Coefs, states: Tensor, g_last: Tensor | None,
    reverse: bool, chunk, dx: Tensor, accumulate: bool, grads, row0: int, g_h0,
):  # fmt: skip
    """One direction: writes (or adds into) dx; writes G_p, G_q, G_γ into ``grads`` (g_p [R, N], g_q and
    g_γ [R, N, 2]) from row ``row0``, G_ω (the forward direction only: ``grads[3]`` not None) and G_h0
    (``g_h0``: two [B, D, N] planes, or None)."""
    b, length, d = x.shape
    n = cf.p.shape[1]
    bd, bn, t, warps = chunk
    nc = triton.cdiv(length, t)
    dev = x.device
    adj = torch.empty(2, b, nc, d, n, device=dev, dtype=torch.float32)
    tan = torch.empty(2, b, nc, d, n, device=dev, dtype=torch.float32)
    grid = (nc, triton.cdiv(d, bd), b)
    pad_arg = pad if pad is not None else x
    _bwd_local_state[grid](
        x, pad_arg, gy, cf.p, cf.qr, cf.qi, cf.gr, cf.gi, adj[0], adj[1], tan[0], tan[1],
        length, d, n, nc, t,
        REVERSE=reverse, HAS_PAD=pad is not None, BD=bd, BN=bn, S=STEPS, QS=cf.qs, GS=cf.gs, num_warps=warps,
    )  # fmt: skip
    block = _state_block(d * n)
    g_q_last = torch.empty(2, b, d, n, device=dev, dtype=torch.float32)
    has_glast = g_last is not None
    h0_out = g_h0 if g_h0 is not None else torch.empty(2, b, d, n, device=dev, dtype=torch.float32)
    _bwd_state_passing[(triton.cdiv(d * n, block), b)](
        adj[0], adj[1], tan[0], tan[1], states[0], states[1],
        g_last[0] if has_glast else adj[0], g_last[1] if has_glast else adj[1],
        cf.qr, cf.qi, h0_out[0], h0_out[1], g_q_last[0], g_q_last[1],
        length, d * n, nc, t,
        HAS_GLAST=has_glast, BLOCK=block, S=STEPS, QS=cf.qs, num_warps=4,
    )  # fmt: skip
    partial = torch.empty(5, b * nc, d, n, device=dev, dtype=torch.float32)  # G_p, Re/Im Wh, Re/Im Wd
    g_omega = torch.empty(b * nc, d, device=dev, dtype=torch.float32)
    _bwd_main[grid](
        x, pad_arg, gy, dx, cf.p, cf.qr, cf.qi, cf.gr, cf.gi, cf.omega,
        adj[0], adj[1], states[0], states[1], tan[0], tan[1],
        partial[0], partial[1], partial[2], partial[3], partial[4], g_omega,
        length, d, n, nc, t,
        REVERSE=reverse, HAS_PAD=pad is not None, ACCUMULATE=accumulate, BD=bd, BN=bn, S=STEPS, QS=cf.qs,
        GS=cf.gs, num_warps=warps,
    )  # fmt: skip
    g_p, g_q, g_g, g_om = grads
    rb, rr = _reduce_block(d * n)
    programs = triton.cdiv(d * n, rb) + (triton.cdiv(d, rb) if g_om is not None else 0)
    _bwd_reduce[(programs,)](
        partial, g_omega, g_q_last, cf.gr, cf.gi, g_p, g_q, g_g, g_om if g_om is not None else g_p,
        d * n, d, b * nc, b * nc * d * n, b, row0 * n,
        HAS_GLAST=has_glast, OMEGA=g_om is not None, GS=cf.gs, RR=rr, BLOCK=rb, num_warps=4,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Custom ops (torch.compile sees opaque calls with known output shapes, no graph break) and autograd
# ----------------------------------------------------------------------------------------------------------


def _directions(p, q_re, q_im, g_re, g_im, omega) -> tuple[_Coefs, _Coefs]:
    """Bidirectional CEMA's two parameter sets: rows [:D] run forward in time with ω, rows [D:] in reverse
    with ω = 0 (the skip term is added once)."""
    d = omega.shape[0]
    fwd = _Coefs(p[:d], q_re[:d], q_im[:d], g_re[:d], g_im[:d], omega)
    return fwd, _Coefs(p[d:], q_re[d:], q_im[d:], g_re[d:], g_im[d:], torch.zeros_like(omega))


def _cema_forward(x, p, q_re, q_im, g_re, g_im, omega, h0_re, h0_im, pad, bidirectional, chunk):
    """(y, Re h_last, Im h_last, forward chunk states, backward chunk states or an empty tensor)."""
    x = x.contiguous()
    b, length, d = x.shape
    n = p.shape[1]
    cfg = _config(b, length, d, n, chunk)
    if bidirectional:
        fwd, bwd = _directions(p, q_re, q_im, g_re, g_im, omega)
        y32 = torch.empty(b, length, d, device=x.device, dtype=torch.float32)
        states_f, _ = _forward(x, pad, fwd, None, None, False, cfg, y32, False)
        states_b, _ = _forward(x, pad, bwd, None, None, True, cfg, y32, True)
        zeros = lambda: x.new_zeros(b, d, n, dtype=torch.float32)
        return y32.to(x.dtype), zeros(), zeros(), states_f, states_b
    cf = _Coefs(p, q_re, q_im, g_re, g_im, omega)
    f = lambda t: None if t is None else t.detach().to(torch.float32).contiguous()
    y = torch.empty_like(x)
    states_f, h_last = _forward(x, pad, cf, f(h0_re), f(h0_im), False, cfg, y, False)
    return y, h_last[0], h_last[1], states_f, x.new_empty(0, dtype=torch.float32)


def _cema_backward(
    gy, gh_re, gh_im, x, p, q_re, q_im, g_re, g_im, omega, pad, states_f, states_b, bidirectional, has_h0, chunk
):  # fmt: skip
    """(dx, G_p [R, N], G_q [R, N, 2], G_γ [R, N, 2] (re, im interleaved), G_ω, Re/Im G_h0 or empty tensors),
    parameter gradients float32."""
    x, gy = x.contiguous(), gy.contiguous()
    b, length, d = x.shape
    rows, n = p.shape
    cfg = _config(b, length, d, n, chunk)
    dev, f32 = x.device, torch.float32
    grads = (
        torch.empty(rows, n, device=dev, dtype=f32),
        torch.empty(rows, n, 2, device=dev, dtype=f32),
        torch.empty(rows, n, 2, device=dev, dtype=f32),
        torch.empty(d, device=dev, dtype=f32),
    )
    no_omega = grads[:3] + (None,)
    h0r, h0i = x.new_empty(0, dtype=f32), x.new_empty(0, dtype=f32)  # two distinct outputs
    if bidirectional:
        fwd, bwd = _directions(p, q_re, q_im, g_re, g_im, omega)
        dx32 = torch.empty(b, length, d, device=dev, dtype=f32)
        _backward(x, pad, gy, fwd, states_f, None, False, cfg, dx32, False, grads, 0, None)
        _backward(x, pad, gy, bwd, states_b, None, True, cfg, dx32, True, no_omega, d, None)
        dx = dx32.to(x.dtype)
    else:
        g_last = None
        if gh_re is not None or gh_im is not None:
            zero = torch.zeros(b, d, n, device=dev, dtype=f32)
            g_last = torch.stack([zero if g is None else g.to(f32) for g in (gh_re, gh_im)])
        dx = torch.empty_like(x)
        g_h0 = None
        if has_h0:
            h0r, h0i = (
                torch.empty(b, d, n, device=dev, dtype=f32),
                torch.empty(b, d, n, device=dev, dtype=f32),
            )
            g_h0 = (h0r, h0i)
        cf = _Coefs(p, q_re, q_im, g_re, g_im, omega)
        _backward(x, pad, gy, cf, states_f, g_last, False, cfg, dx, False, grads, 0, g_h0)
    return (dx, *grads, h0r, h0i)


@torch.library.custom_op(
    "mega_suite::cema_fwd",
    mutates_args=(),
    schema="(Tensor x, Tensor p, Tensor q_re, Tensor q_im, Tensor g_re, Tensor g_im, Tensor omega, Tensor? h0_re, "
    "Tensor? h0_im, Tensor? pad, bool bidirectional, int? chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _cema_fwd_op(x, p, q_re, q_im, g_re, g_im, omega, h0_re, h0_im, pad, bidirectional, chunk):
    return _cema_forward(x, p, q_re, q_im, g_re, g_im, omega, h0_re, h0_im, pad, bidirectional, chunk)


@_cema_fwd_op.register_fake
def _(x, p, q_re, q_im, g_re, g_im, omega, h0_re, h0_im, pad, bidirectional, chunk):
    b, length, d = x.shape
    n = p.shape[1]
    nc = triton.cdiv(length, _config(b, length, d, n, chunk)[2])
    state = lambda: x.new_empty(2, b, nc, d, n, dtype=torch.float32)
    h = lambda: x.new_empty(b, d, n, dtype=torch.float32)
    return (
        x.new_empty(x.shape),
        h(),
        h(),
        state(),
        state() if bidirectional else x.new_empty(0, dtype=torch.float32),
    )


@torch.library.custom_op(
    "mega_suite::cema_bwd",
    mutates_args=(),
    schema="(Tensor gy, Tensor? gh_re, Tensor? gh_im, Tensor x, Tensor p, Tensor q_re, Tensor q_im, Tensor g_re, "
    "Tensor g_im, Tensor omega, Tensor? pad, Tensor states_f, Tensor states_b, bool bidirectional, bool has_h0, "
    "int? chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _cema_bwd_op(gy, gh_re, gh_im, x, p, q_re, q_im, g_re, g_im, omega, pad, states_f, states_b, bidirectional,
                 has_h0, chunk):  # fmt: skip
    return _cema_backward(
        gy, gh_re, gh_im, x, p, q_re, q_im, g_re, g_im, omega, pad, states_f, states_b, bidirectional, has_h0,
        chunk,
    )  # fmt: skip


@_cema_bwd_op.register_fake
def _(gy, gh_re, gh_im, x, p, q_re, q_im, g_re, g_im, omega, pad, states_f, states_b, bidirectional, has_h0,
      chunk):  # fmt: skip
    b, _, d = x.shape
    rows, n = p.shape
    h0 = lambda: x.new_empty((b, d, n) if has_h0 and not bidirectional else (0,), dtype=torch.float32)
    return (x.new_empty(x.shape), p.new_empty(rows, n, dtype=torch.float32),
            p.new_empty(rows, n, 2, dtype=torch.float32), p.new_empty(rows, n, 2, dtype=torch.float32),
            omega.new_empty(omega.shape, dtype=torch.float32), h0(), h0())  # fmt: skip


def cema_autograd(name: str, fwd_op, bwd_op) -> type[torch.autograd.Function]:
    """An autograd Function over a pair of CEMA custom ops with the signatures of ``mega_suite::cema_fwd`` /
    ``cema_bwd`` (the scan's here, the tensor-core form's in ``kernels.cema.tensor_cores``). Real-valued
    interface: q and γ enter as interleaved (re, im) [R, N, 2] tensors (``view_as_real`` of the complex ones,
    or the coefficient kernel's outputs) and get their gradients in the same layout, so no complex arithmetic
    runs in either direction; h0 enters as (re, im) planes. The kernels run inside the custom ops, so
    torch.compile keeps a block that uses them in one graph."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, p, q_ri, g_ri, omega, h0_re, h0_im, pad, bidirectional, chunk):
            y, h_re, h_im, saved_a, saved_b = fwd_op(
                x, p, q_ri[..., 0], q_ri[..., 1], g_ri[..., 0], g_ri[..., 1], omega, h0_re, h0_im, pad,
                bidirectional, chunk,
            )  # fmt: skip
            ctx.save_for_backward(x, pad, p, q_ri, g_ri, omega, saved_a, saved_b)
            ctx.bidirectional, ctx.chunk, ctx.has_h0 = bidirectional, chunk, h0_re is not None
            ctx.set_materialize_grads(False)
            return y, h_re, h_im

        @staticmethod
        def backward(ctx, gy, gh_re, gh_im):
            x, pad, p, q_ri, g_ri, omega, saved_a, saved_b = ctx.saved_tensors
            if gy is None:
                gy = torch.zeros_like(x)
            if ctx.bidirectional:
                gh_re = gh_im = None
            dx, g_p, g_q, g_g, g_omega, gh0_re, gh0_im = bwd_op(
                gy, gh_re, gh_im, x, p, q_ri[..., 0], q_ri[..., 1], g_ri[..., 0], g_ri[..., 1], omega, pad, saved_a,
                saved_b, ctx.bidirectional, ctx.has_h0, ctx.chunk,
            )  # fmt: skip
            h0_grads = (gh0_re, gh0_im) if ctx.has_h0 else (None, None)
            return (dx, g_p, g_q, g_g, g_omega, *h0_grads, None, None, None)

    Function.__name__ = Function.__qualname__ = name
    return Function


CEMAFunction = cema_autograd("CEMAFunction", torch.ops.mega_suite.cema_fwd, torch.ops.mega_suite.cema_bwd)


def _interleaved(z: Tensor) -> Tensor:
    """A complex [R, N] tensor as (re, im) [R, N, 2] float32: a view for complex64 (no copy, no kernel)."""
    z = z.resolve_conj()
    return torch.view_as_real(z if z.dtype == torch.complex64 else z.to(torch.complex64))


def cema(
    x: Tensor,
    p: Tensor,
    q: Tensor,
    gamma: Tensor,
    omega: Tensor,
    h0: Tensor | None = None,
    bidirectional: bool = False,
    padding_mask: Tensor | None = None,
    return_state: bool = False,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Complex EMA over the time axis by the fused chunked scan; same contract as the reference ``cema``.

    Args:
        x: [B, L, D] real input (float32 / float16 / bfloat16; state and math in float32).
        p: [D, N] real (bidirectional: [2D, N], forward rows first).
        q: [D, N] complex, |q| < 1 (bidirectional: [2D, N]).
        gamma: [D, N] complex output projection (bidirectional: [2D, N]).
        omega: [D] real skip weight.
        h0: [B, D, N] complex carried state, or None for zeros (causal only).
        padding_mask: [B, L] bool, True = padding; padded inputs are zeroed first.
        return_state: also return h_{L-1} [B, D, N] complex64 (causal only).
        chunk_size: steps per chunk (one program each); None picks one from the shape.

    Returns:
        y [B, L, D] in x's dtype, and h_last [B, D, N] complex64 or None.
    """
    check_cema_args(x, p, q, gamma, h0, bidirectional, padding_mask, return_state)
    b, length, d = x.shape
    if length == 0:
        from kernels.cema.reference import cema as reference_cema

        return reference_cema(
            x, p, q, gamma, omega, h0, bidirectional, padding_mask, "sequential", return_state
        )
    pad = None if padding_mask is None else padding_mask.to(torch.int8).contiguous()
    h0_re = h0_im = None
    if h0 is not None:
        h0_re, h0_im = h0.real, h0.imag
    y, hl_re, hl_im = CEMAFunction.apply(
        x, p, _interleaved(q), _interleaved(gamma), omega, h0_re, h0_im, pad, bidirectional, chunk_size
    )
    return y, (torch.complex(hl_re, hl_im) if return_state else None)


# ----------------------------------------------------------------------------------------------------------
# Coefficients from the raw parameters: one kernel forward, one backward
# ----------------------------------------------------------------------------------------------------------


def _coef_launch(rows: int, n: int):
    bn = triton.next_power_of_2(n)
    br = max(1, min(triton.next_power_of_2(rows), 256 // bn))  # float64 sin / cos: few elements per thread
    return (triton.cdiv(rows, br),), br, bn


def _check_parameters(alpha: Tensor, delta: Tensor, theta: Tensor, gamma: Tensor) -> None:
    rows, n = alpha.shape[:2]
    expected = {"alpha": (rows, n, 1), "delta": (rows, n, 1), "theta": (rows, 1, 1), "gamma": (rows, n, 2)}
    for name, t in zip(expected, (alpha, delta, theta, gamma)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(
                f"CEMA parameter {name} must be {expected[name]} (rows, N from alpha), got {tuple(t.shape)}"
            )


@torch.library.custom_op(
    "mega_suite::cema_coefficients_fwd",
    mutates_args=(),
    schema="(Tensor alpha, Tensor delta, Tensor theta, Tensor gamma) -> (Tensor, Tensor, Tensor)",
)
def _coef_fwd_op(alpha, delta, theta, gamma):
    return _coefficients_forward(alpha, delta, theta, gamma)


def _coefficients_forward(alpha, delta, theta, gamma):
    """(p [R, N], q [R, N, 2], γ [R, N, 2]) float32, q and γ interleaved (re, im)."""
    rows, n = alpha.shape[:2]
    dev, f32 = alpha.device, torch.float32
    p = torch.empty(rows, n, device=dev, dtype=f32)
    q = torch.empty(rows, n, 2, device=dev, dtype=f32)
    g = torch.empty(rows, n, 2, device=dev, dtype=f32)
    grid, br, bn = _coef_launch(rows, n)
    _coef_fwd[grid](
        alpha.contiguous(), delta.contiguous(), theta.contiguous(), gamma.contiguous(), p, q, g, rows, n,
        n**-0.5, BR=br, BN=bn, num_warps=4,
    )  # fmt: skip
    return p, q, g


@_coef_fwd_op.register_fake
def _(alpha, delta, theta, gamma):
    rows, n = alpha.shape[:2]
    f32 = torch.float32
    return (
        alpha.new_empty(rows, n, dtype=f32),
        alpha.new_empty(rows, n, 2, dtype=f32),
        alpha.new_empty(rows, n, 2, dtype=f32),
    )


@torch.library.custom_op(
    "mega_suite::cema_coefficients_bwd",
    mutates_args=(),
    schema="(Tensor g_p, Tensor g_q, Tensor g_gamma, Tensor alpha, Tensor delta, Tensor theta) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)
def _coef_bwd_op(g_p, g_q, g_gamma, alpha, delta, theta):
    return _coefficients_backward(g_p, g_q, g_gamma, alpha, delta, theta)


def _coefficients_backward(g_p, g_q, g_gamma, alpha, delta, theta):
    """Gradients of alpha [R, N, 1], delta [R, N, 1], theta [R, 1, 1], gamma [R, N, 2], float32."""
    rows, n = alpha.shape[:2]
    dev, f32 = alpha.device, torch.float32
    da = torch.empty(rows, n, 1, device=dev, dtype=f32)
    dd = torch.empty(rows, n, 1, device=dev, dtype=f32)
    dt = torch.empty(rows, 1, 1, device=dev, dtype=f32)
    dg = torch.empty(rows, n, 2, device=dev, dtype=f32)
    grid, br, bn = _coef_launch(rows, n)
    f = lambda t: t.to(f32).contiguous()
    _coef_bwd[grid](
        alpha.contiguous(), delta.contiguous(), theta.contiguous(), f(g_p), f(g_q), f(g_gamma), da, dd, dt, dg,
        rows, n, n**-0.5, BR=br, BN=bn, num_warps=4,
    )  # fmt: skip
    return da, dd, dt, dg


@_coef_bwd_op.register_fake
def _(g_p, g_q, g_gamma, alpha, delta, theta):
    f32 = torch.float32
    return (alpha.new_empty(alpha.shape, dtype=f32), delta.new_empty(delta.shape, dtype=f32),
            theta.new_empty(theta.shape, dtype=f32), alpha.new_empty(*alpha.shape[:2], 2, dtype=f32))  # fmt: skip


class CEMACoefficientsFunction(torch.autograd.Function):
    """Raw parameters -> (p [R, N], q [R, N, 2], γ [R, N, 2]) float32, q and γ as interleaved (re, im); one
    kernel each way (custom ops ``mega_suite::cema_coefficients_fwd`` / ``_bwd``), float64 inside."""

    @staticmethod
    def forward(ctx, alpha, delta, theta, gamma):
        p, q, g = torch.ops.mega_suite.cema_coefficients_fwd(alpha, delta, theta, gamma)
        ctx.save_for_backward(alpha, delta, theta)
        ctx.dtypes = (alpha.dtype, delta.dtype, theta.dtype, gamma.dtype)
        return p, q, g

    @staticmethod
    def backward(ctx, g_p, g_q, g_gamma):
        alpha, delta, theta = ctx.saved_tensors
        grads = torch.ops.mega_suite.cema_coefficients_bwd(g_p, g_q, g_gamma, alpha, delta, theta)
        return tuple(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes))


def cema_coefficients_real(alpha: Tensor, delta: Tensor, theta: Tensor, gamma: Tensor):
    """(p [R, N], q [R, N, 2], γ [R, N, 2]) float32 from alpha, delta [R, N, 1], theta [R, 1, 1], gamma
    [R, N, 2]: p = σ(α), q = (1 - σ(α) σ(δ)) exp(i n σ(θ) 2π/N), γ / sqrt(N), q and γ as (re, im)."""
    _check_parameters(alpha, delta, theta, gamma)
    return CEMACoefficientsFunction.apply(alpha, delta, theta, gamma)


def cema_coefficients(alpha: Tensor, delta: Tensor, theta: Tensor, gamma: Tensor):
    """``cema_coefficients_real`` with q and γ returned as complex64 [R, N] views of the kernel's outputs
    (the reference's contract): no complex arithmetic runs, forward or backward."""
    p, q, g = cema_coefficients_real(alpha, delta, theta, gamma)
    return p, torch.view_as_complex(q), torch.view_as_complex(g)


def cema_from_parameters(
    x: Tensor,
    alpha: Tensor,
    delta: Tensor,
    theta: Tensor,
    gamma: Tensor,
    omega: Tensor,
    bidirectional: bool = False,
    padding_mask: Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """CEMA straight from the raw parameters, no complex tensor anywhere: the coefficient kernel, then the
    scan. x [B, L, D]; parameters as ``cema_coefficients_real`` ([2D] rows bidirectional); omega [D].
    Returns y [B, L, D] in x's dtype."""
    p, q, g = cema_coefficients_real(alpha, delta, theta, gamma)
    rows = 2 * x.shape[-1] if bidirectional else x.shape[-1]
    if x.dim() != 3 or p.shape[0] != rows:
        raise ValueError(
            f"cema_from_parameters: x must be [B, L, D] with {rows} parameter rows "
            f"(bidirectional={bidirectional}); got x {tuple(x.shape)} and {p.shape[0]} rows"
        )
    if x.shape[1] == 0:
        return x.clone()
    pad = None if padding_mask is None else padding_mask.to(torch.int8).contiguous()
    y, _, _ = CEMAFunction.apply(x, p, q, g, omega, None, None, pad, bidirectional, chunk_size)
    return y
