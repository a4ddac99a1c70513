"""CEMA as GEMMs on the tensor cores (docs/architecture.md#cema, docs/kernels.md#cema): the chunked form.

Per channel d with N complex modes, chunks of T = 16 S steps, x with padded steps zeroed, chunk c's steps
j = 0..T-1 (the last chunk, c_L = NC - 1, has T_L <= T steps):

    y_c[i]  = Σ_{j<=i} k_{i-j} x_c[j] + Re(Σ_n γ_n q_n^{i+1} h_c) + ω x_c[i]     k_ℓ = Re(Σ_n γ p q^ℓ), ℓ < T
    h_{c+1} = q^T h_c + p Σ_j q^{T-1-j} x_c[j]                                  h_0 = h0 (the chunk start states)
    h_last  = q^{T_L} h_{c_L} + p Σ_{j<T_L} q^{T_L-1-j} x_{c_L}[j]

so inside a chunk y is a lower-triangular Toeplitz matrix K times x, the state enters through a [T x N]
Vandermonde matrix (q^{i+1}) and leaves through an [N x T] one (q^{T-1-j}). A program owns (BD channels,
batch row) and sweeps the chunks in blocks of R = 16: a tile is [BD, R chunks, 16 steps] and every product
is a 3-D ``tl.dot`` (a batch of BD per-channel GEMMs, R rows) at ``input_precision="tf32x3"`` (float32
accuracy from three TF32 products; CEMA is a float32 island, docs/architecture.md#float32-islands). K is
used as S x S blocks of 16 x 16, of which the S (S + 1) / 2 on or below the diagonal are non-zero and S are
distinct (block (a, b) depends on a - b only). Complex quantities are (re, im) float32 pairs; a product of
the real x with a complex table is two real GEMMs.

forward (``_tc_fwd``), per block of chunks c0 .. c0 + R - 1:
  H'     = p ⊙ (X' @ Q_in)     X' the block's x one chunk earlier (rows c0 - 1 ..): row k is the state
                               increment of chunk c0 + k - 1, Q_in[j, n] = q^{T-1-j}
  h      = scan of h_k = q^T h_{k-1} + e_k over the R rows (``tl.associative_scan`` on the complex affine
           maps), e = H' with h0 (first block) or q^T h_{c0-1} (the carry) added to row 0: an exclusive scan
           without moving registers, since X' is already shifted
  y      = Σ_{b<=a} X_b @ K_{a-b}  +  Re(γ ⊙ h) @ Q_out - Im(γ ⊙ h) @ Q_out' + ω X     per 16-step tile a
  Each block's first start state is saved for the backward (N complex per 16 T steps and channel), and
  the last chunk's start state; h_last is formed after the sweep (the ragged last chunk's powers q^{T_L-1-j}
  are read from the table at shifted indices, so no negative power appears).

backward, with gy = ∂L/∂y, G_last = ∂L/∂h_last and PyTorch's convention for complex gradients
(G_z = ∂L/∂Re z + i ∂L/∂Im z), in three sweeps (one sweep doing all of it spills registers):
  ``_tc_bwd_dx``     right to left: ρ_c = G_{h_{c+1}} by a reverse scan of ρ_{c-1} = Ψ_c + conj(q^{T_c}) ρ_c,
                     Ψ_c = conj(γ) Σ_i gy_c[i] conj(q^{i+1}) (from the block's gy one chunk later), ρ_{c_L} =
                     G_last; dx = Σ_{a>=b} GY_a @ K_{a-b}ᵀ + Re(conj(Q_in) p ρ) + ω gy (the last chunk's
                     ρ = G_last at shifted powers); each block's incoming ρ saved, and ρ_0
  ``_tc_bwd_state``  ρ and h per block recomputed from the saved ones: G_p = Σ_c Re(conj(ρ_c) (X @ Q_in)_c),
                     G_q += Σ_c conj(p (X @ Q_in')_c) ρ_c + conj(T q^{T-1}) Σ_c ρ_c conj(h_c)
  ``_tc_bwd_out``    h per block: G_γ = Σ_c conj(h_c) (GY @ conj(Q_out))_c, G_q += Σ_c conj(γ h_c)
                     (GY @ conj(Q_out'))_c, the taps' correlations X_bᵀ GY_a (a - b = m: S tiles of 16 x 16 per
                     channel), G_ω, G_h0 = Ψ_0 + conj(q^{T_0}) ρ_0
  (Q_in' = ∂Q_in/∂q = (T-1-j) q^{T-2-j}, Q_out' = (i+1) q^i; the last chunk's terms through h_last.)
  ``_tc_reduce`` sums the per-(batch row, channel) partials in a fixed order (no atomics) and adds the taps'
  share in float64: G_p += Σ_ℓ G_k[ℓ] Re(γ q^ℓ), G_γ += Σ_ℓ G_k[ℓ] conj(p q^ℓ), G_q += Σ_ℓ G_k[ℓ] conj(γ p ℓ q^{ℓ-1}).

tables (``_tc_tables``, once per call for all parameter rows): q^e for e = 0..T and the taps k_ℓ, ℓ < T,
computed in float64 from the float32 q by repeated squaring (the error is ~log2(T) float64 roundings, against
the ℓ-fold growth of a float32 arg q) and rounded once to float32.

Bidirectional CEMA runs the forward and backward kernels a second time on the reversed time axis
(``REVERSE``) with the second parameter set and no ω, adding into y and dx. Entry points mirror
``kernels.cema.triton``: ``cema`` (complex q, γ, h0) and ``cema_from_parameters`` (the coefficient kernel's
real outputs, no complex tensor), through the custom ops ``mega_suite::cema_tc_fwd`` / ``cema_tc_bwd``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.cema.reference import check_cema_args
from kernels.cema.triton import _interleaved, _pair, cema_autograd, cema_coefficients_real

__all__ = ["CEMATensorCoreFunction", "CHUNKS", "cema", "cema_from_parameters"]

ROWS = 16  # chunks per block: the M dimension of every GEMM (tl.dot needs >= 16)
CHUNKS = (16, 32, 64, 128)  # allowed steps per chunk (multiples of the 16-step tile)
DEFAULT_CHUNK = 32  # fewer multiply-adds than 64, and no register spills (docs/kernels.md#cema)
BLOCK_D = 4  # channels per program: the batch dimension of the 3-D dots
WARPS = 8
# modes per program: tl.dot needs 16 on a GPU; the interpreter (CPU tests) emulates the scans element by
# element, so there N is padded only to a power of two (the masks of the padded modes are the same code)
_MIN_BN = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 16
SLOTS: tl.constexpr = tl.constexpr(10)  # partial gradient vectors per (batch row, channel), see _tc_reduce


# ----------------------------------------------------------------------------------------------- helpers


@triton.jit
def _combine(ar, ai, br, bi, cr, ci, dr, di):
    """The affine maps s -> A s + b (complex) of two scan elements composed, the earlier (A1, b1) first:
    (A2 A1, A2 b1 + b2). The same order serves the reverse scan (the later element is the left one)."""
    return cr * ar - ci * ai, cr * ai + ci * ar, cr * br - ci * bi + dr, cr * bi + ci * br + di


@triton.jit
def _pow64(qr, qi, e, BITS: tl.constexpr):
    """q^e for integer e in [0, 2^BITS) by repeated squaring in float64 (q broadcast against e)."""
    zero = (e * 0).to(tl.float64)
    br, bi = qr + zero, qi + zero
    rr, ri = zero + 1.0, zero
    for i in tl.static_range(BITS):
        odd = ((e >> i) & 1) != 0
        rr, ri = tl.where(odd, rr * br - ri * bi, rr), tl.where(odd, rr * bi + ri * br, ri)
        br, bi = br * br - bi * bi, 2.0 * br * bi
    return rr, ri


@triton.jit
def _steps(c_first, col0, L, D, offs_d, mask_d, T, R: tl.constexpr, REVERSE: tl.constexpr):
    """Offsets [BD, R, 16] into a [L, D] row, their mask, and the times t [R, 16] with their mask: row k is
    chunk c_first + k, column u its scan step col0 + u; steps outside [0, L) and chunks < 0 are masked."""
    c = c_first + tl.arange(0, R)
    tau = c[:, None] * T + col0 + tl.arange(0, 16)[None, :]
    ok = (c[:, None] >= 0) & (tau < L)
    if REVERSE:
        t = L - 1 - tau
    else:
        t = tau
    t = t.to(tl.int64)
    off = t[None, :, :] * D + offs_d[:, None, None]
    return off, mask_d[:, None, None] & ok[None, :, :], t, ok


@triton.jit
def _tile(row_ptr, pad_row, c_first, col0, L, D, offs_d, mask_d, T,
          R: tl.constexpr, REVERSE: tl.constexpr, HAS_PAD: tl.constexpr):  # fmt: skip
    """[BD, R, 16] float32 tile of a [B, L, D] tensor (rows: chunks, columns: steps), zero where masked and
    at padding."""
    off, mask, t, ok = _steps(c_first, col0, L, D, offs_d, mask_d, T, R, REVERSE)
    tile = tl.load(row_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_PAD:
        pad = tl.load(pad_row + t, mask=ok, other=0)
        tile = tl.where(pad[None, :, :] != 0, 0.0, tile)
    return tile


@triton.jit
def _pw(pw_ptr, PLANE, rowbase, e, n, BN: tl.constexpr, mask):
    """(re, im) of q^e from the power table [2, rows, T + 1, BN] (rowbase = channel * (T + 1)); index
    tensors broadcast, ``mask`` must exclude e outside [0, T]."""
    off = (rowbase + e) * BN + n
    return tl.load(pw_ptr + off, mask=mask, other=0.0), tl.load(pw_ptr + PLANE + off, mask=mask, other=0.0)


@triton.jit
def _toeplitz(taps_ptr, rowbase, mask_d, m, plus, minus):
    """[BD, 16, 16] block of the Toeplitz matrix: element = k[16 m + plus - minus], zero where negative
    (rowbase [BD, 1, 1] = channel * T)."""
    lag = 16 * m + plus - minus
    return tl.load(taps_ptr + rowbase + lag, mask=mask_d[:, None, None] & (lag >= 0), other=0.0)


@triton.jit
def _coefficients(
    p_ptr, gr_ptr, gi_ptr, om_ptr, dn, offs_d, m2, mask_d, GS: tl.constexpr, OMEGA: tl.constexpr
):
    """p, Re γ, Im γ as [BD, 1, BN] and ω as [BD, 1, 1] (zero without OMEGA)."""
    p = tl.load(p_ptr + dn, mask=m2, other=0.0)[:, None, :]
    gr = tl.load(gr_ptr + dn * GS, mask=m2, other=0.0)[:, None, :]
    gi = tl.load(gi_ptr + dn * GS, mask=m2, other=0.0)[:, None, :]
    om = tl.zeros([offs_d.shape[0], 1, 1], dtype=tl.float32)
    if OMEGA:
        om = tl.load(om_ptr + offs_d, mask=mask_d, other=0.0)[:, None, None]
    return p, gr, gi, om


@triton.jit
def _rows(t, k3, row):
    """Row ``row`` of a [BD, R, BN] tile as [BD, BN] (zero if no row matches)."""
    return tl.sum(tl.where(k3 == row, t, 0.0), axis=1)


@triton.jit
def _increments(x_row, pad_row, c_first, p, L, D, offs_d, mask_d, pw_ptr, PLANE, rowg, n3, md3, v3,
                T: tl.constexpr, S: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
                REVERSE: tl.constexpr, HAS_PAD: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """p ⊙ (X @ Q_in): row k the state increment Σ_j p q^{T-1-j} x_c[j] of chunk c = c_first + k, [BD, R, BN]."""
    hr = tl.zeros([BD, R, BN], dtype=tl.float32)
    hi = tl.zeros([BD, R, BN], dtype=tl.float32)
    for s in tl.static_range(S):
        xs = _tile(x_row, pad_row, c_first, s * 16, L, D, offs_d, mask_d, T, R, REVERSE, HAS_PAD)
        wr, wi = _pw(pw_ptr, PLANE, rowg, T - 1 - s * 16 - v3, n3, BN, md3)
        hr = tl.dot(xs, wr, hr, input_precision=PREC)
        hi = tl.dot(xs, wi, hi, input_precision=PREC)
    return hr * p, hi * p


# ------------------------------------------------------------------------------------------------- tables


@triton.jit
def _tc_tables(
    p_ptr, qr_ptr, qi_ptr, gr_ptr, gi_ptr, pw_ptr, taps_ptr, N, T, PLANE,
    QS: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """One row (channel): pw[r, e, n] = q^e, e = 0..T (zero for n >= N), and the taps k[r, ℓ] =
    Re(Σ_n γ p q^ℓ), ℓ < T; float64 inside, rounded once to float32."""
    r = tl.program_id(0)
    n = tl.arange(0, BN)
    mn = n < N
    idx = r * N + n
    p = tl.load(p_ptr + idx, mask=mn, other=0.0).to(tl.float64)
    qr = tl.load(qr_ptr + idx * QS, mask=mn, other=0.0).to(tl.float64)
    qi = tl.load(qi_ptr + idx * QS, mask=mn, other=0.0).to(tl.float64)
    gr = tl.load(gr_ptr + idx * GS, mask=mn, other=0.0).to(tl.float64)
    gi = tl.load(gi_ptr + idx * GS, mask=mn, other=0.0).to(tl.float64)
    tp = T + 1
    for e0 in range(0, tp, BE):
        e = e0 + tl.arange(0, BE)
        pr, pi = _pow64(qr[None, :], qi[None, :], e[:, None], BITS)
        pr = tl.where(mn[None, :], pr, 0.0)
        pi = tl.where(mn[None, :], pi, 0.0)
        off = (r * tp + e[:, None]) * BN + n[None, :]
        ok = (e < tp)[:, None]
        tl.store(pw_ptr + off, pr.to(tl.float32), mask=ok)
        tl.store(pw_ptr + PLANE + off, pi.to(tl.float32), mask=ok)
        tap = tl.sum(p[None, :] * (gr[None, :] * pr - gi[None, :] * pi), axis=1)
        tl.store(taps_ptr + r * T + e, tap.to(tl.float32), mask=e < T)


# ------------------------------------------------------------------------------------------------ forward


@triton.jit(do_not_specialize=["ZERO"])
def _tc_fwd(
    x_ptr, pad_ptr, yin_ptr, y_ptr, p_ptr, gr_ptr, gi_ptr, om_ptr, pw_ptr, taps_ptr,
    h0r_ptr, h0i_ptr, hlr_ptr, hli_ptr, hb_ptr, hsr_ptr, hsi_ptr,
    L, D, N, NC, NG, TL, PLANE, HB_PLANE, ZERO,
    T: tl.constexpr, S: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, GS: tl.constexpr,
    REVERSE: tl.constexpr, HAS_PAD: tl.constexpr, HAS_H0: tl.constexpr, FINAL: tl.constexpr,
    OMEGA: tl.constexpr, ACCUMULATE: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """y for (BD channels, batch row) over all chunks; the start state of every block (hb), of the last chunk
    (hs) and h_last (FINAL)."""
    pd, b = tl.program_id(0), tl.program_id(1)
    offs_d = pd * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    n = tl.arange(0, BN)
    m2 = mask_d[:, None] & (n < N)[None, :]
    dn = offs_d[:, None] * N + n[None, :]
    tp = T + 1
    row2 = offs_d[:, None] * tp
    row3 = offs_d[:, None, None] * tp
    md3 = mask_d[:, None, None]
    k3 = tl.arange(0, R)[None, :, None]
    v3 = tl.arange(0, 16)[None, :, None]
    u3 = tl.arange(0, 16)[None, None, :]
    n3 = n[None, None, :]
    nr3 = n[None, :, None]

    b64 = b.to(tl.int64)
    x_row = x_ptr + b64 * L * D
    y_row = y_ptr + b64 * L * D
    yin_row = yin_ptr + b64 * L * D
    pad_row = pad_ptr + b64 * L
    if HAS_H0:
        h0r = tl.load(h0r_ptr + b64 * D * N + dn, mask=m2, other=0.0)
        h0i = tl.load(h0i_ptr + b64 * D * N + dn, mask=m2, other=0.0)
    else:
        h0r = tl.zeros([BD, BN], dtype=tl.float32)
        h0i = tl.zeros([BD, BN], dtype=tl.float32)
    cr = tl.zeros([BD, BN], dtype=tl.float32)  # carry: the start state of the previous block's last chunk
    ci = tl.zeros([BD, BN], dtype=tl.float32)
    slr = tl.zeros([BD, BN], dtype=tl.float32)  # the start state of the last chunk
    sli = tl.zeros([BD, BN], dtype=tl.float32)

    for g in range(NG):
        c0 = g * R
        # indices that vary (by 0) with the block: otherwise the compiler hoists every table tile, coefficient
        # broadcast and address tile out of the loop and holds them in registers, where they spill; re-read
        # per block they come from L1
        z = g * ZERO
        rowg = row3 + z
        tapg = offs_d[:, None, None] * T + z
        p, gr, gi, om = _coefficients(
            p_ptr, gr_ptr, gi_ptr, om_ptr, dn + z, offs_d + z, m2, mask_d, GS, OMEGA
        )
        qtr, qti = _pw(pw_ptr, PLANE, row2 + z, T, n[None, :], BN, mask_d[:, None])  # q^T
        ar = tl.zeros([BD, R, BN], dtype=tl.float32) + qtr[:, None, :]
        ai = tl.zeros([BD, R, BN], dtype=tl.float32) + qti[:, None, :]
        # state increments of chunks c0 - 1 .. c0 + R - 2: p ⊙ (X' @ Q_in)
        hr, hi = _increments(
            x_row, pad_row, c0 - 1, p, L, D, offs_d, mask_d, pw_ptr, PLANE, rowg, n3, md3, v3,
            T, S, R, BD, BN, REVERSE, HAS_PAD, PREC,
        )  # fmt: skip
        ir = tl.where(g == 0, h0r, qtr * cr - qti * ci)
        ii = tl.where(g == 0, h0i, qtr * ci + qti * cr)
        first = k3 == 0
        er = hr + tl.where(first, ir[:, None, :], 0.0)
        ei = hi + tl.where(first, ii[:, None, :], 0.0)
        _, _, sr, si = tl.associative_scan((ar, ai, er, ei), 1, _combine)  # chunk start states
        hb = ((b64 * NG + g) * D + offs_d[:, None]) * N + n[None, :]
        tl.store(hb_ptr + hb, _rows(sr, k3, 0), mask=m2)
        tl.store(hb_ptr + HB_PLANE + hb, _rows(si, k3, 0), mask=m2)
        cr = _rows(sr, k3, R - 1)
        ci = _rows(si, k3, R - 1)
        if FINAL:
            slr += _rows(sr, k3, NC - 1 - c0)
            sli += _rows(si, k3, NC - 1 - c0)
        # y = Toeplitz + Re(γ h) Q_out - Im(γ h) Q_out' + ω x, 16 steps at a time
        zr = gr * sr - gi * si
        zn = -(gr * si + gi * sr)
        xt = ()
        for s in tl.static_range(S):
            xt = xt + (_tile(x_row, pad_row, c0, s * 16, L, D, offs_d, mask_d, T, R, REVERSE, HAS_PAD),)
        for a in tl.static_range(S):
            wr, wi = _pw(pw_ptr, PLANE, rowg, a * 16 + 1 + u3, nr3, BN, md3)  # [BD, BN, 16]: q^{i+1}
            ya = tl.dot(zr, wr, input_precision=PREC)
            ya = tl.dot(zn, wi, ya, input_precision=PREC)
            for s in tl.static_range(a + 1):
                ya = tl.dot(xt[s], _toeplitz(taps_ptr, tapg, mask_d, a - s, u3, v3), ya, input_precision=PREC)
            if OMEGA:
                ya += om * xt[a]
            off, mask, _, _ = _steps(c0, a * 16, L, D, offs_d, mask_d, T, R, REVERSE)
            if ACCUMULATE:
                ya += tl.load(yin_row + off, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + off, ya.to(y_ptr.dtype.element_ty), mask=mask)

    if FINAL:
        # h_last = q^{T_L} h_{c_L} + p Σ_{j<T_L} q^{T_L-1-j} x_{c_L}[j] (causal only: no REVERSE)
        st = b64 * D * N + dn
        tl.store(hsr_ptr + st, slr, mask=m2)
        tl.store(hsi_ptr + st, sli, mask=m2)
        lr = tl.zeros([BD, BN], dtype=tl.float32)
        li = tl.zeros([BD, BN], dtype=tl.float32)
        for s in tl.static_range(S):
            j = s * 16 + tl.arange(0, 16)
            ok = j < TL
            t = ((NC - 1) * T + j).to(tl.int64)
            xv = tl.load(
                x_row + t[None, :] * D + offs_d[:, None], mask=mask_d[:, None] & ok[None, :], other=0.0
            )
            xv = xv.to(tl.float32)
            if HAS_PAD:
                xv = tl.where(tl.load(pad_row + t, mask=ok, other=0)[None, :] != 0, 0.0, xv)
            j3 = s * 16 + v3
            wr, wi = _pw(pw_ptr, PLANE, row3, TL - 1 - j3, n3, BN, md3 & (j3 < TL))
            lr += tl.sum(wr * xv[:, :, None], axis=1)
            li += tl.sum(wi * xv[:, :, None], axis=1)
        qlr, qli = _pw(pw_ptr, PLANE, row2, TL, n[None, :], BN, mask_d[:, None])  # q^{T_L}
        p2 = tl.load(p_ptr + dn, mask=m2, other=0.0)
        tl.store(hlr_ptr + st, qlr * slr - qli * sli + p2 * lr, mask=m2)
        tl.store(hli_ptr + st, qlr * sli + qli * slr + p2 * li, mask=m2)


# ----------------------------------------------------------------------------------------------- backward


@triton.jit
def _adjoints(gy_row, pad_row, c0, cr, ci, glr, gli, gr, gi, qtr, qti, qlr, qli, L, D, NC, offs_d, mask_d,
              pw_ptr, PLANE, rowg, n3, md3, k3, v3,
              T: tl.constexpr, S: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
              REVERSE: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """ρ_c = G_{h_{c+1}} for the block's chunks c = c0 + k, [BD, R, BN] each plane, by a reverse scan of
    ρ_{c-1} = Ψ_c + conj(q^{T_c}) ρ_c over Ψ of chunks c0 + 1 .. c0 + R (their gy one chunk later), from
    (cr, ci) = ρ_{c0+R}; ρ_{c_L} = G_last (glr, gli, zero if none)."""
    o_r = tl.zeros([BD, R, BN], dtype=tl.float32)
    o_i = tl.zeros([BD, R, BN], dtype=tl.float32)
    for s in tl.static_range(S):
        gys = _tile(gy_row, gy_row, c0 + 1, s * 16, L, D, offs_d, mask_d, T, R, REVERSE, False)
        wr, wi = _pw(pw_ptr, PLANE, rowg, s * 16 + 1 + v3, n3, BN, md3)
        o_r = tl.dot(gys, wr, o_r, input_precision=PREC)
        o_i = tl.dot(gys, wi, o_i, input_precision=PREC)
    # Ψ = conj(γ) Σ_i gy[i] conj(q^{i+1})
    er = gr * o_r - gi * o_i
    ei = -(gr * o_i + gi * o_r)
    dec_r = tl.where(c0 + R == NC - 1, qlr, qtr)  # q^{T_c} of chunk c0 + R
    dec_i = tl.where(c0 + R == NC - 1, qli, qti)
    last = k3 == R - 1
    er += tl.where(last, (dec_r * cr + dec_i * ci)[:, None, :], 0.0)
    ei += tl.where(last, (dec_r * ci - dec_i * cr)[:, None, :], 0.0)
    at_last = (c0 + k3) == NC - 1
    er += tl.where(at_last, glr[:, None, :], 0.0)
    ei += tl.where(at_last, gli[:, None, :], 0.0)
    before_last = (c0 + k3 + 1) == NC - 1
    ar = tl.where(before_last, qlr[:, None, :], qtr[:, None, :] + tl.zeros([BD, R, BN], dtype=tl.float32))
    ai = -tl.where(before_last, qli[:, None, :], qti[:, None, :] + tl.zeros([BD, R, BN], dtype=tl.float32))
    _, _, rr, ri = tl.associative_scan((ar, ai, er, ei), 1, _combine, reverse=True)
    return rr, ri


@triton.jit(do_not_specialize=["ZERO"])
def _tc_bwd_dx(
    x_ptr, pad_ptr, gy_ptr, dxin_ptr, dx_ptr, p_ptr, gr_ptr, gi_ptr, om_ptr, pw_ptr, taps_ptr,
    hsr_ptr, hsi_ptr, glr_ptr, gli_ptr, rb_ptr, r0_ptr, vp_ptr,
    L, D, N, NC, NG, TL, PLANE, RB_PLANE, R0_PLANE, VP_B, ZERO,
    T: tl.constexpr, S: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, GS: tl.constexpr,
    REVERSE: tl.constexpr, HAS_PAD: tl.constexpr, HAS_GLAST: tl.constexpr, OMEGA: tl.constexpr,
    ACCUMULATE: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Right to left over (BD channels, batch row): the adjoints ρ (each block's incoming one saved to rb, ρ_0
    to r0) and dx; the last chunk's share of G_p, G_q through h_last (vp[0], vp[1:3])."""
    pd, b = tl.program_id(0), tl.program_id(1)
    offs_d = pd * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    n = tl.arange(0, BN)
    m2 = mask_d[:, None] & (n < N)[None, :]
    dn = offs_d[:, None] * N + n[None, :]
    tp = T + 1
    row2 = offs_d[:, None] * tp
    row3 = offs_d[:, None, None] * tp
    md3 = mask_d[:, None, None]
    md2 = mask_d[:, None]
    k3 = tl.arange(0, R)[None, :, None]
    v3 = tl.arange(0, 16)[None, :, None]
    u3 = tl.arange(0, 16)[None, None, :]
    n3 = n[None, None, :]
    nr3 = n[None, :, None]

    p2 = tl.load(p_ptr + dn, mask=m2, other=0.0)
    p = p2[:, None, :]
    b64 = b.to(tl.int64)
    x_row = x_ptr + b64 * L * D
    gy_row = gy_ptr + b64 * L * D
    dx_row = dx_ptr + b64 * L * D
    dxin_row = dxin_ptr + b64 * L * D
    pad_row = pad_ptr + b64 * L

    a_p = tl.zeros([BD, BN], dtype=tl.float32)
    a_qr = tl.zeros([BD, BN], dtype=tl.float32)
    a_qi = tl.zeros([BD, BN], dtype=tl.float32)
    corr = ()  # dx of the last chunk from G_last: Re(conj(p q^{T_L-1-j}) G_last), per 16-step tile
    glr = tl.zeros([BD, BN], dtype=tl.float32)
    gli = tl.zeros([BD, BN], dtype=tl.float32)
    if HAS_GLAST:
        # h_last = q^{T_L} h_{c_L} + p Σ_{j<T_L} q^{T_L-1-j} x_{c_L}[j]: G_p, G_q and dx of the last chunk
        stl = b64 * D * N + dn
        glr = tl.load(glr_ptr + stl, mask=m2, other=0.0)
        gli = tl.load(gli_ptr + stl, mask=m2, other=0.0)
        slr = tl.load(hsr_ptr + stl, mask=m2, other=0.0)
        sli = tl.load(hsi_ptr + stl, mask=m2, other=0.0)
        ql1r, ql1i = _pw(pw_ptr, PLANE, row2, TL - 1, n[None, :], BN, md2)
        lr = TL * (ql1r * slr - ql1i * sli)  # ∂(q^{T_L} h)/∂q
        li = TL * (ql1r * sli + ql1i * slr)
        a_qr += lr * glr + li * gli
        a_qi += lr * gli - li * glr
        lxr = tl.zeros([BD, BN], dtype=tl.float32)
        lxi = tl.zeros([BD, BN], dtype=tl.float32)
        ldr = tl.zeros([BD, BN], dtype=tl.float32)
        ldi = tl.zeros([BD, BN], dtype=tl.float32)
        for s in tl.static_range(S):
            jl = s * 16 + tl.arange(0, 16)
            okl = jl < TL
            tt = ((NC - 1) * T + jl).to(tl.int64)
            xv = tl.load(x_row + tt[None, :] * D + offs_d[:, None], mask=md2 & okl[None, :], other=0.0)
            xv = xv.to(tl.float32)
            if HAS_PAD:
                xv = tl.where(tl.load(pad_row + tt, mask=okl, other=0)[None, :] != 0, 0.0, xv)
            jl3 = s * 16 + v3
            wr3, wi3 = _pw(pw_ptr, PLANE, row3, TL - 1 - jl3, n3, BN, md3 & (jl3 < TL))
            lxr += tl.sum(wr3 * xv[:, :, None], axis=1)
            lxi += tl.sum(wi3 * xv[:, :, None], axis=1)
            corr = corr + (tl.sum(p * (wr3 * glr[:, None, :] + wi3 * gli[:, None, :]), axis=2),)
            dr3, di3 = _pw(pw_ptr, PLANE, row3, TL - 2 - jl3, n3, BN, md3 & (jl3 < TL - 1))
            fl3 = (TL - 1 - jl3).to(tl.float32)
            ldr += tl.sum(fl3 * dr3 * xv[:, :, None], axis=1)
            ldi += tl.sum(fl3 * di3 * xv[:, :, None], axis=1)
        a_p += lxr * glr + lxi * gli
        a_qr += p2 * (ldr * glr + ldi * gli)
        a_qi += p2 * (ldr * gli - ldi * glr)
    else:
        for _s in tl.static_range(S):
            corr = corr + (tl.zeros([BD, 16], dtype=tl.float32),)
    cr = tl.zeros([BD, BN], dtype=tl.float32)  # ρ of the first chunk of the block to the right
    ci = tl.zeros([BD, BN], dtype=tl.float32)

    for gg in range(NG):
        g = NG - 1 - gg
        c0 = g * R
        z = g * ZERO  # (see _tc_fwd)
        rowg = row3 + z
        tapg = offs_d[:, None, None] * T + z
        p, gr, gi, om = _coefficients(
            p_ptr, gr_ptr, gi_ptr, om_ptr, dn + z, offs_d + z, m2, mask_d, GS, OMEGA
        )
        p2 = tl.sum(p, axis=1)
        qtr, qti = _pw(pw_ptr, PLANE, row2 + z, T, n[None, :], BN, md2)  # q^T
        qlr, qli = _pw(pw_ptr, PLANE, row2 + z, TL, n[None, :], BN, md2)  # q^{T_L}
        zf = z.to(tl.float32)
        rb = ((b64 * NG + g) * D + offs_d[:, None]) * N + n[None, :]
        tl.store(rb_ptr + rb, cr, mask=m2)
        tl.store(rb_ptr + RB_PLANE + rb, ci, mask=m2)
        rr, ri = _adjoints(
            gy_row, pad_row, c0, cr, ci, glr + zf, gli + zf, gr, gi, qtr, qti, qlr, qli, L, D, NC, offs_d, mask_d,
            pw_ptr, PLANE, rowg, n3, md3, k3, v3, T, S, R, BD, BN, REVERSE, PREC,
        )  # fmt: skip
        cr = _rows(rr, k3, 0)
        ci = _rows(ri, k3, 0)
        valid = (c0 + k3) < NC - 1  # ρ of the last chunk (G_last) was taken care of before the sweep
        mr = tl.where(valid, rr, 0.0)
        mi = tl.where(valid, ri, 0.0)
        # dx = Toeplitzᵀ gy + Re(conj(p q^{T-1-j}) ρ) + ω gy (+ the last chunk's G_last term)
        pr = p * mr
        pi = p * mi
        for s in tl.static_range(S):
            wr, wi = _pw(pw_ptr, PLANE, rowg, T - 1 - s * 16 - u3, nr3, BN, md3)  # [BD, BN, 16]
            dxs = tl.dot(pr, wr, input_precision=PREC)
            dxs = tl.dot(pi, wi, dxs, input_precision=PREC)
            for a in tl.static_range(s, S):
                gys = _tile(gy_row, pad_row, c0, a * 16, L, D, offs_d, mask_d, T, R, REVERSE, False)
                dxs = tl.dot(gys, _toeplitz(taps_ptr, tapg, mask_d, a - s, v3, u3), dxs, input_precision=PREC)
                if OMEGA and a == s:
                    dxs += om * gys
            if HAS_GLAST:
                dxs += tl.where((c0 + k3) == NC - 1, (corr[s] + zf)[:, None, :], 0.0)
            off, mask, t, ok = _steps(c0, s * 16, L, D, offs_d, mask_d, T, R, REVERSE)
            if HAS_PAD:
                dxs = tl.where(tl.load(pad_row + t, mask=ok, other=0)[None, :, :] != 0, 0.0, dxs)
            if ACCUMULATE:
                dxs += tl.load(dxin_row + off, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_row + off, dxs.to(dx_ptr.dtype.element_ty), mask=mask)

    st = b64 * D * N + dn
    tl.store(r0_ptr + st, cr, mask=m2)
    tl.store(r0_ptr + R0_PLANE + st, ci, mask=m2)
    vp = vp_ptr + b64 * VP_B + (offs_d[:, None] * SLOTS) * BN + n[None, :]
    tl.store(vp, a_p, mask=md2)
    tl.store(vp + BN, a_qr, mask=md2)
    tl.store(vp + 2 * BN, a_qi, mask=md2)


@triton.jit(do_not_specialize=["ZERO"])
def _tc_bwd_state(
    x_ptr, pad_ptr, gy_ptr, p_ptr, gr_ptr, gi_ptr, pw_ptr, hb_ptr, rb_ptr, glr_ptr, gli_ptr, vp_ptr,
    L, D, N, NC, NG, TL, PLANE, HB_PLANE, RB_PLANE, VP_B, ZERO,
    T: tl.constexpr, S: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, GS: tl.constexpr,
    REVERSE: tl.constexpr, HAS_PAD: tl.constexpr, HAS_GLAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Over (BD channels, batch row), any order: ρ (from the blocks' saved incoming adjoints) and h (from their
    saved start states) per chunk; G_p (vp[3]) and G_q (vp[4:6]) through the state increments p X @ Q_in and
    the decays q^T."""
    pd, b = tl.program_id(0), tl.program_id(1)
    offs_d = pd * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    n = tl.arange(0, BN)
    m2 = mask_d[:, None] & (n < N)[None, :]
    dn = offs_d[:, None] * N + n[None, :]
    tp = T + 1
    row2 = offs_d[:, None] * tp
    row3 = offs_d[:, None, None] * tp
    md3 = mask_d[:, None, None]
    md2 = mask_d[:, None]
    k3 = tl.arange(0, R)[None, :, None]
    v3 = tl.arange(0, 16)[None, :, None]
    n3 = n[None, None, :]

    b64 = b.to(tl.int64)
    x_row = x_ptr + b64 * L * D
    gy_row = gy_ptr + b64 * L * D
    pad_row = pad_ptr + b64 * L
    glr = tl.zeros([BD, BN], dtype=tl.float32)
    gli = tl.zeros([BD, BN], dtype=tl.float32)
    if HAS_GLAST:
        glr = tl.load(glr_ptr + b64 * D * N + dn, mask=m2, other=0.0)
        gli = tl.load(gli_ptr + b64 * D * N + dn, mask=m2, other=0.0)

    a_p = tl.zeros([BD, BN], dtype=tl.float32)
    a_qr = tl.zeros([BD, BN], dtype=tl.float32)
    a_qi = tl.zeros([BD, BN], dtype=tl.float32)

    for g in range(NG):
        c0 = g * R
        z = g * ZERO  # (see _tc_fwd)
        rowg = row3 + z
        p, gr, gi, _ = _coefficients(p_ptr, gr_ptr, gi_ptr, p_ptr, dn + z, offs_d + z, m2, mask_d, GS, False)
        qtr, qti = _pw(pw_ptr, PLANE, row2 + z, T, n[None, :], BN, md2)  # q^T
        qt1r, qt1i = _pw(pw_ptr, PLANE, row2 + z, T - 1, n[None, :], BN, md2)  # q^{T-1}
        qlr, qli = _pw(pw_ptr, PLANE, row2 + z, TL, n[None, :], BN, md2)  # q^{T_L}
        zf = z.to(tl.float32)
        blk = ((b64 * NG + g) * D + offs_d[:, None]) * N + n[None, :]
        cr = tl.load(rb_ptr + blk, mask=m2, other=0.0)
        ci = tl.load(rb_ptr + RB_PLANE + blk, mask=m2, other=0.0)
        rr, ri = _adjoints(
            gy_row, pad_row, c0, cr, ci, glr + zf, gli + zf, gr, gi, qtr, qti, qlr, qli, L, D, NC, offs_d, mask_d,
            pw_ptr, PLANE, rowg, n3, md3, k3, v3, T, S, R, BD, BN, REVERSE, PREC,
        )  # fmt: skip
        hr, hi = _increments(
            x_row, pad_row, c0 - 1, p, L, D, offs_d, mask_d, pw_ptr, PLANE, rowg, n3, md3, v3,
            T, S, R, BD, BN, REVERSE, HAS_PAD, PREC,
        )  # fmt: skip
        first = k3 == 0
        er = tl.where(first, tl.load(hb_ptr + blk, mask=m2, other=0.0)[:, None, :], hr)
        ei = tl.where(first, tl.load(hb_ptr + HB_PLANE + blk, mask=m2, other=0.0)[:, None, :], hi)
        atr = qtr[:, None, :] + tl.zeros([BD, R, BN], dtype=tl.float32)
        ati = qti[:, None, :] + tl.zeros([BD, R, BN], dtype=tl.float32)
        _, _, sr, si = tl.associative_scan((atr, ati, er, ei), 1, _combine)  # h_c
        # the decays: G_q += conj(T q^{T-1}) Σ_c ρ_c conj(h_c) over c < c_L
        valid = (c0 + k3) < NC - 1
        mr = tl.where(valid, rr, 0.0)
        mi = tl.where(valid, ri, 0.0)
        tr = tl.sum(mr * sr + mi * si, axis=1)
        ti = tl.sum(mi * sr - mr * si, axis=1)
        a_qr += T * (qt1r * tr + qt1i * ti)
        a_qi += T * (qt1r * ti - qt1i * tr)
        # G_p = Σ Re(conj(ρ) X @ Q_in), G_q += Σ conj(p X @ Q_in') ρ, Q_in' = (T-1-j) q^{T-2-j}
        hxr = tl.zeros([BD, R, BN], dtype=tl.float32)
        hxi = tl.zeros([BD, R, BN], dtype=tl.float32)
        hdr = tl.zeros([BD, R, BN], dtype=tl.float32)
        hdi = tl.zeros([BD, R, BN], dtype=tl.float32)
        for s in tl.static_range(S):
            xs = _tile(x_row, pad_row, c0, s * 16, L, D, offs_d, mask_d, T, R, REVERSE, HAS_PAD)
            j3 = s * 16 + v3
            wr, wi = _pw(pw_ptr, PLANE, rowg, T - 1 - j3, n3, BN, md3)
            hxr = tl.dot(xs, wr, hxr, input_precision=PREC)
            hxi = tl.dot(xs, wi, hxi, input_precision=PREC)
            wr, wi = _pw(pw_ptr, PLANE, rowg, T - 2 - j3, n3, BN, md3 & (j3 < T - 1))
            f3 = (T - 1 - j3).to(tl.float32)
            hdr = tl.dot(xs, f3 * wr, hdr, input_precision=PREC)
            hdi = tl.dot(xs, f3 * wi, hdi, input_precision=PREC)
        p2 = tl.sum(p, axis=1)
        a_p += tl.sum(mr * hxr + mi * hxi, axis=1)
        a_qr += p2 * tl.sum(hdr * mr + hdi * mi, axis=1)
        a_qi += p2 * tl.sum(hdr * mi - hdi * mr, axis=1)

    vp = vp_ptr + b64 * VP_B + (offs_d[:, None] * SLOTS) * BN + n[None, :]
    tl.store(vp + 3 * BN, a_p, mask=md2)
    tl.store(vp + 4 * BN, a_qr, mask=md2)
    tl.store(vp + 5 * BN, a_qi, mask=md2)


@triton.jit(do_not_specialize=["ZERO"])
def _tc_bwd_out(
    x_ptr, pad_ptr, gy_ptr, p_ptr, gr_ptr, gi_ptr, pw_ptr, hb_ptr, r0_ptr, gh0r_ptr, gh0i_ptr, gb_ptr,
    vp_ptr, gom_ptr,
    L, D, N, NC, NG, TL, PLANE, HB_PLANE, R0_PLANE, GB_B, VP_B, ZERO,
    T: tl.constexpr, S: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, GS: tl.constexpr,
    REVERSE: tl.constexpr, HAS_PAD: tl.constexpr, HAS_H0: tl.constexpr, OMEGA: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """Over (BD channels, batch row), any order: h per chunk (from the blocks' saved start states); G_q (vp[6:8])
    and G_γ (vp[8:10]) through the outputs, the taps' correlations X_sᵀ GY_{s+m} (gb), G_ω and G_h0."""
    pd, b = tl.program_id(0), tl.program_id(1)
    offs_d = pd * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    n = tl.arange(0, BN)
    m2 = mask_d[:, None] & (n < N)[None, :]
    dn = offs_d[:, None] * N + n[None, :]
    tp = T + 1
    row2 = offs_d[:, None] * tp
    row3 = offs_d[:, None, None] * tp
    md3 = mask_d[:, None, None]
    md2 = mask_d[:, None]
    k3 = tl.arange(0, R)[None, :, None]
    v3 = tl.arange(0, 16)[None, :, None]
    u3 = tl.arange(0, 16)[None, None, :]
    n3 = n[None, None, :]

    b64 = b.to(tl.int64)
    x_row = x_ptr + b64 * L * D
    gy_row = gy_ptr + b64 * L * D
    pad_row = pad_ptr + b64 * L
    a_qr = tl.zeros([BD, BN], dtype=tl.float32)
    a_qi = tl.zeros([BD, BN], dtype=tl.float32)
    a_gr = tl.zeros([BD, BN], dtype=tl.float32)
    a_gi = tl.zeros([BD, BN], dtype=tl.float32)
    gom = tl.zeros([BD], dtype=tl.float32)
    gk = ()
    for _s in tl.static_range(S):
        gk = gk + (tl.zeros([BD, 16, 16], dtype=tl.float32),)
    o0r = tl.zeros([BD, BN], dtype=tl.float32)  # Ω_0, for G_h0
    o0i = tl.zeros([BD, BN], dtype=tl.float32)

    for g in range(NG):
        c0 = g * R
        z = g * ZERO  # (see _tc_fwd)
        rowg = row3 + z
        p, gr, gi, _ = _coefficients(p_ptr, gr_ptr, gi_ptr, p_ptr, dn + z, offs_d + z, m2, mask_d, GS, False)
        qtr, qti = _pw(pw_ptr, PLANE, row2 + z, T, n[None, :], BN, md2)  # q^T
        blk = ((b64 * NG + g) * D + offs_d[:, None]) * N + n[None, :]
        hr, hi = _increments(
            x_row, pad_row, c0 - 1, p, L, D, offs_d, mask_d, pw_ptr, PLANE, rowg, n3, md3, v3,
            T, S, R, BD, BN, REVERSE, HAS_PAD, PREC,
        )  # fmt: skip
        first = k3 == 0
        er = tl.where(first, tl.load(hb_ptr + blk, mask=m2, other=0.0)[:, None, :], hr)
        ei = tl.where(first, tl.load(hb_ptr + HB_PLANE + blk, mask=m2, other=0.0)[:, None, :], hi)
        atr = qtr[:, None, :] + tl.zeros([BD, R, BN], dtype=tl.float32)
        ati = qti[:, None, :] + tl.zeros([BD, R, BN], dtype=tl.float32)
        _, _, sr, si = tl.associative_scan((atr, ati, er, ei), 1, _combine)  # h_c
        # the outputs: Ω = GY @ conj(Q_out), Ω' = GY @ conj(Q_out'), Q_out' = (i+1) q^i;
        # G_γ = Σ conj(h) Ω, G_q += Σ conj(γ h) Ω'
        o_r = tl.zeros([BD, R, BN], dtype=tl.float32)
        o_i = tl.zeros([BD, R, BN], dtype=tl.float32)
        od_r = tl.zeros([BD, R, BN], dtype=tl.float32)
        od_i = tl.zeros([BD, R, BN], dtype=tl.float32)
        for s in tl.static_range(S):
            gys = _tile(gy_row, pad_row, c0, s * 16, L, D, offs_d, mask_d, T, R, REVERSE, False)
            j3 = s * 16 + v3
            wr, wi = _pw(pw_ptr, PLANE, rowg, j3 + 1, n3, BN, md3)
            o_r = tl.dot(gys, wr, o_r, input_precision=PREC)
            o_i = tl.dot(gys, wi, o_i, input_precision=PREC)
            wr, wi = _pw(pw_ptr, PLANE, rowg, j3, n3, BN, md3)
            f3 = (j3 + 1).to(tl.float32)
            od_r = tl.dot(gys, f3 * wr, od_r, input_precision=PREC)
            od_i = tl.dot(gys, f3 * wi, od_i, input_precision=PREC)
        o_i = -o_i
        od_i = -od_i
        a_gr += tl.sum(sr * o_r + si * o_i, axis=1)
        a_gi += tl.sum(sr * o_i - si * o_r, axis=1)
        zr = gr * sr - gi * si
        zi = gr * si + gi * sr
        a_qr += tl.sum(zr * od_r + zi * od_i, axis=1)
        a_qi += tl.sum(zr * od_i - zi * od_r, axis=1)
        if HAS_H0:
            o0r += _rows(o_r, k3, -c0)
            o0i += _rows(o_i, k3, -c0)
        # the taps' correlations X_sᵀ GY_{s+m} (lag 16 m + u - v), and G_ω = Σ gy x
        new = ()
        for m in tl.static_range(S):
            acc = gk[m]
            for s in tl.static_range(S - m):
                xs = _tile(x_row, pad_row, c0, s * 16, L, D, offs_d, mask_d, T, R, REVERSE, HAS_PAD)
                gys = _tile(gy_row, pad_row, c0, (s + m) * 16, L, D, offs_d, mask_d, T, R, REVERSE, False)
                acc = tl.dot(tl.permute(xs, (0, 2, 1)), gys, acc, input_precision=PREC)
                if OMEGA and m == 0:
                    gom += tl.sum(tl.sum(gys * xs, axis=2), axis=1)
            new = new + (acc,)
        gk = new

    if HAS_H0:
        # G_h0 = Ψ_0 + conj(q^{T_0}) ρ_0, Ψ_0 = conj(γ) Ω_0
        st = b64 * D * N + dn
        g0r = tl.load(gr_ptr + dn * GS, mask=m2, other=0.0)
        g0i = tl.load(gi_ptr + dn * GS, mask=m2, other=0.0)
        d0r, d0i = _pw(pw_ptr, PLANE, row2, tl.where(NC == 1, TL, T), n[None, :], BN, md2)
        r0r = tl.load(r0_ptr + st, mask=m2, other=0.0)
        r0i = tl.load(r0_ptr + R0_PLANE + st, mask=m2, other=0.0)
        tl.store(gh0r_ptr + st, g0r * o0r + g0i * o0i + d0r * r0r + d0i * r0i, mask=m2)
        tl.store(gh0i_ptr + st, g0r * o0i - g0i * o0r + d0r * r0i - d0i * r0r, mask=m2)
    vp = vp_ptr + b64 * VP_B + (offs_d[:, None] * SLOTS) * BN + n[None, :]
    tl.store(vp + 6 * BN, a_qr, mask=md2)
    tl.store(vp + 7 * BN, a_qi, mask=md2)
    tl.store(vp + 8 * BN, a_gr, mask=md2)
    tl.store(vp + 9 * BN, a_gi, mask=md2)
    gb = gb_ptr + b64 * GB_B + offs_d[:, None, None] * (S * 256) + v3 * 16 + u3
    for m in tl.static_range(S):
        tl.store(gb + m * 256, gk[m], mask=md3)
    if OMEGA:
        tl.store(gom_ptr + b64 * D + offs_d, gom, mask=mask_d)


@triton.jit
def _tc_reduce(
    gb_ptr, vp_ptr, gom_ptr, p_ptr, qr_ptr, qi_ptr, gr_ptr, gi_ptr, gp_ptr, gq_ptr, gg_ptr, gomo_ptr,
    B, ROWS, N, D, T,
    QS: tl.constexpr, GS: tl.constexpr, S: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr,
    BITS: tl.constexpr,
):  # fmt: skip
    """Row r: the partials summed over the batch rows in order, plus the taps' share in float64
    (G_k[ℓ] = Σ_v gb[(ℓ+v) // 16][v][(ℓ+v) % 16]); G_q, G_γ interleaved (re, im). Rows < D also sum G_ω."""
    r = tl.program_id(0)
    n = tl.arange(0, BN)
    mn = n < N
    l2 = tl.arange(0, BL)[:, None]
    v2 = tl.arange(0, 16)[None, :]
    m2 = (l2 + v2) // 16
    u2 = (l2 + v2) % 16
    ok = (l2 < T) & (m2 < S)
    gk = tl.zeros([BL], dtype=tl.float32)
    s_p = tl.zeros([BN], dtype=tl.float32)
    s_qr = tl.zeros([BN], dtype=tl.float32)
    s_qi = tl.zeros([BN], dtype=tl.float32)
    s_gr = tl.zeros([BN], dtype=tl.float32)
    s_gi = tl.zeros([BN], dtype=tl.float32)
    for b in range(B):
        row = b * ROWS + r
        vp = vp_ptr + row.to(tl.int64) * SLOTS * BN + n
        s_p += tl.load(vp) + tl.load(vp + 3 * BN)
        s_qr += tl.load(vp + BN) + tl.load(vp + 4 * BN) + tl.load(vp + 6 * BN)
        s_qi += tl.load(vp + 2 * BN) + tl.load(vp + 5 * BN) + tl.load(vp + 7 * BN)
        s_gr += tl.load(vp + 8 * BN)
        s_gi += tl.load(vp + 9 * BN)
        gb = gb_ptr + row.to(tl.int64) * S * 256
        gk += tl.sum(tl.load(gb + m2 * 256 + v2 * 16 + u2, mask=ok, other=0.0), axis=1)
    idx = r * N + n
    p = tl.load(p_ptr + idx, mask=mn, other=0.0).to(tl.float64)
    qr = tl.load(qr_ptr + idx * QS, mask=mn, other=0.0).to(tl.float64)
    qi = tl.load(qi_ptr + idx * QS, mask=mn, other=0.0).to(tl.float64)
    gr = tl.load(gr_ptr + idx * GS, mask=mn, other=0.0).to(tl.float64)
    gi = tl.load(gi_ptr + idx * GS, mask=mn, other=0.0).to(tl.float64)
    ell = tl.arange(0, BL)[:, None]
    pr, pi = _pow64(qr[None, :], qi[None, :], ell, BITS)  # q^ℓ
    p1r, p1i = _pow64(qr[None, :], qi[None, :], tl.maximum(ell - 1, 0), BITS)  # q^{ℓ-1}
    k = gk.to(tl.float64)[:, None]
    kl = k * ell.to(tl.float64)
    g_p = s_p.to(tl.float64) + tl.sum(k * (gr[None, :] * pr - gi[None, :] * pi), axis=0)
    g_gr = s_gr.to(tl.float64) + p * tl.sum(k * pr, axis=0)
    g_gi = s_gi.to(tl.float64) - p * tl.sum(k * pi, axis=0)
    # conj(γ p ℓ q^{ℓ-1}) G_k
    g_qr = s_qr.to(tl.float64) + p * tl.sum(kl * (gr[None, :] * p1r - gi[None, :] * p1i), axis=0)
    g_qi = s_qi.to(tl.float64) - p * tl.sum(kl * (gr[None, :] * p1i + gi[None, :] * p1r), axis=0)
    tl.store(gp_ptr + idx, g_p.to(tl.float32), mask=mn)
    tl.store(gq_ptr + 2 * idx, g_qr.to(tl.float32), mask=mn)
    tl.store(gq_ptr + 2 * idx + 1, g_qi.to(tl.float32), mask=mn)
    tl.store(gg_ptr + 2 * idx, g_gr.to(tl.float32), mask=mn)
    tl.store(gg_ptr + 2 * idx + 1, g_gi.to(tl.float32), mask=mn)
    if r < D:
        acc = tl.zeros([1], dtype=tl.float32)
        for b in range(B):
            acc += tl.load(gom_ptr + b * D + r + tl.arange(0, 1))
        tl.store(gomo_ptr + r + tl.arange(0, 1), acc)


# ---------------------------------------------------------------------------------------------- launchers


class _Shape:
    """The launch geometry of one call: T steps per chunk (S tiles of 16), NC chunks (the last of T_L
    steps), NG blocks of ROWS chunks, BD channels and BN >= N (padded to 16 for the GEMMs) modes a program."""

    def __init__(self, batch: int, length: int, dim: int, ndim: int, chunk: int, device: torch.device):
        self.b, self.length, self.d, self.n, self.t = batch, length, dim, ndim, chunk
        self.s = chunk // 16
        self.nc = triton.cdiv(length, chunk)
        self.ng = triton.cdiv(self.nc, ROWS)
        self.t_last = length - (self.nc - 1) * chunk
        self.bd = min(BLOCK_D, triton.next_power_of_2(dim))
        self.bn = max(_MIN_BN, triton.next_power_of_2(ndim))
        self.bits = chunk.bit_length()  # exponents up to T
        self.grid = (triton.cdiv(dim, self.bd), batch)
        self.prec = _precision(device)


def _precision(device: torch.device) -> str:
    # tf32x3 needs TF32 tensor cores (sm_80+); the interpreter and meta tensors take the GPU path's value
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        return "ieee"
    return "tf32x3"


def resolve_chunk(length: int, chunk: int | None) -> int:
    """Steps per chunk: ``chunk`` (one of CHUNKS) or, by default, 64 cut down to the smallest tile multiple
    that holds the sequence."""
    if chunk is None:
        return max(16, min(DEFAULT_CHUNK, triton.next_power_of_2(max(1, length))))
    if chunk not in CHUNKS:
        raise ValueError(f"tensor-core CEMA chunk_size must be one of {CHUNKS}, got {chunk}")
    return chunk


def _tables(p: Tensor, qr: Tensor, qi: Tensor, qs: int, gr: Tensor, gi: Tensor, gs: int, sh: _Shape):
    """(pw [2, rows, T + 1, BN] = q^e, taps [rows, T]) float32 for all parameter rows."""
    rows = p.shape[0]
    pw = torch.empty(2, rows, sh.t + 1, sh.bn, device=p.device, dtype=torch.float32)
    taps = torch.empty(rows, sh.t, device=p.device, dtype=torch.float32)
    _tc_tables[(rows,)](
        p, qr, qi, gr, gi, pw, taps, sh.n, sh.t, pw.stride(0),
        QS=qs, GS=gs, BN=sh.bn, BE=16, BITS=sh.bits, num_warps=1,
    )  # fmt: skip
    return pw, taps


class _Params:
    """p [rows, N] float32 contiguous; q, γ as (re, im) planes with their element stride (1, or 2 when the
    halves of an interleaved [rows, N, 2] tensor); ω [D] float32."""

    def __init__(self, p, q_re, q_im, g_re, g_im, omega):
        f = lambda t: t.detach().to(torch.float32).contiguous()
        self.p, self.omega = f(p), f(omega)
        self.qr, self.qi, self.qs = _pair(q_re, q_im)
        self.gr, self.gi, self.gs = _pair(g_re, g_im)

    def rows(self, start: int, stop: int):
        """(p, γ re, γ im) of parameter rows [start, stop) as views (no copy)."""
        return self.p[start:stop], self.gr[start:stop], self.gi[start:stop]


def _fwd_launch(
    x, pad, y_in, y, cf: _Params, pw, taps, row0, h0, out, sh: _Shape, reverse, final, omega, acc
):
    d = sh.d
    p, gr, gi = cf.rows(row0, row0 + d)
    hl, hb, hs = out
    h0r, h0i = h0 if h0 is not None else (hl[0], hl[1])
    _tc_fwd[sh.grid](
        x, pad if pad is not None else x, y_in, y, p, gr, gi, cf.omega, pw[:, row0:], taps[row0:],
        h0r, h0i, hl[0], hl[1], hb, hs[0], hs[1],
        sh.length, d, sh.n, sh.nc, sh.ng, sh.t_last, pw.stride(0), hb.stride(0), 0,
        T=sh.t, S=sh.s, R=ROWS, BD=sh.bd, BN=sh.bn, GS=cf.gs, REVERSE=reverse, HAS_PAD=pad is not None,
        HAS_H0=h0 is not None, FINAL=final, OMEGA=omega, ACCUMULATE=acc, PREC=sh.prec, num_warps=WARPS, num_stages=1,
    )  # fmt: skip


def _tc_forward(x, p, q_re, q_im, g_re, g_im, omega, h0_re, h0_im, pad, bidirectional, chunk):
    """(y, Re h_last, Im h_last, block start states [dirs, 2, B, NG, D, N], last chunk's start state
    [2, B, D, N]); float32 states."""
    x = x.contiguous()
    b, length, d = x.shape
    n = p.shape[1]
    sh = _Shape(b, length, d, n, chunk, x.device)
    cf = _Params(p, q_re, q_im, g_re, g_im, omega)
    pw, taps = _tables(cf.p, cf.qr, cf.qi, cf.qs, cf.gr, cf.gi, cf.gs, sh)
    dirs = 2 if bidirectional else 1
    f32 = torch.float32
    hb = torch.empty(dirs, 2, b, sh.ng, d, n, device=x.device, dtype=f32)
    h_re, h_im = (torch.empty(b, d, n, device=x.device, dtype=f32) for _ in range(2))
    hs = torch.empty(2, b, d, n, device=x.device, dtype=f32)
    y = torch.empty_like(x)
    if bidirectional:
        y32 = torch.empty(b, length, d, device=x.device, dtype=f32)
        _fwd_launch(
            x, pad, y32, y32, cf, pw, taps, 0, None, ((h_re, h_im), hb[0], hs), sh, False, False, True, False
        )
        _fwd_launch(
            x, pad, y32, y, cf, pw, taps, d, None, ((h_re, h_im), hb[1], hs), sh, True, False, False, True
        )
        h_re.zero_(), h_im.zero_(), hs.zero_()
    else:
        f = lambda t: t.detach().to(f32).contiguous()
        h0 = None if h0_re is None else (f(h0_re), f(h0_im))
        _fwd_launch(
            x, pad, y, y, cf, pw, taps, 0, h0, ((h_re, h_im), hb[0], hs), sh, False, True, True, False
        )
    return y, h_re, h_im, hb, hs


def _tc_backward(
    gy, gh_re, gh_im, x, p, q_re, q_im, g_re, g_im, omega, pad, hb, hs, bidirectional, has_h0, chunk
):  # fmt: skip
    """(dx, G_p [R, N], G_q [R, N, 2], G_γ [R, N, 2] (re, im interleaved), G_ω, Re / Im G_h0 or empty
    tensors), parameter gradients float32."""
    x, gy = x.contiguous(), gy.contiguous()
    b, length, d = x.shape
    rows, n = p.shape
    sh = _Shape(b, length, d, n, chunk, x.device)
    cf = _Params(p, q_re, q_im, g_re, g_im, omega)
    pw, taps = _tables(cf.p, cf.qr, cf.qi, cf.qs, cf.gr, cf.gi, cf.gs, sh)
    dev, f32 = x.device, torch.float32
    gb = torch.empty(b, rows, sh.s, 16, 16, device=dev, dtype=f32)
    vp = torch.empty(b, rows, SLOTS, sh.bn, device=dev, dtype=f32)
    gom = torch.empty(b, d, device=dev, dtype=f32)
    empty = lambda: x.new_empty(0, dtype=f32)
    gh0 = (torch.empty(b, d, n, device=dev, dtype=f32), torch.empty(b, d, n, device=dev, dtype=f32))
    if bidirectional or not has_h0:
        gh0 = (empty(), empty())
    g_last = None
    if not bidirectional and (gh_re is not None or gh_im is not None):
        zero = lambda: torch.zeros(b, d, n, device=dev, dtype=f32)
        g_last = tuple(zero() if g is None else g.to(f32).contiguous() for g in (gh_re, gh_im))

    def launch(dx_in, dx, row0, dir_hb, reverse, omega_grads, acc, g_h0):
        pr, gr, gi = cf.rows(row0, row0 + d)
        glast = g_last is not None and not reverse
        gl = g_last if glast else (hs[0], hs[1])
        h0_out = g_h0 if g_h0 is not None else (hs[0], hs[1])
        rb = torch.empty(2, b, sh.ng, d, n, device=dev, dtype=f32)  # each block's incoming adjoint
        r0 = torch.empty(2, b, d, n, device=dev, dtype=f32)
        pad_arg = pad if pad is not None else x
        pw_d, vp_d = pw[:, row0:], vp[:, row0:]
        common = dict(T=sh.t, S=sh.s, R=ROWS, BD=sh.bd, BN=sh.bn, GS=cf.gs, REVERSE=reverse,
                      HAS_PAD=pad is not None, PREC=sh.prec, num_warps=WARPS, num_stages=1)  # fmt: skip
        shape = (length, d, n, sh.nc, sh.ng, sh.t_last, pw.stride(0))
        _tc_bwd_dx[sh.grid](
            x, pad_arg, gy, dx_in, dx, pr, gr, gi, cf.omega, pw_d, taps[row0:], hs[0], hs[1], gl[0], gl[1],
            rb, r0, vp_d, *shape, rb.stride(0), r0.stride(0), vp.stride(0), 0,
            HAS_GLAST=glast, OMEGA=omega_grads, ACCUMULATE=acc, **common,
        )  # fmt: skip
        _tc_bwd_state[sh.grid](
            x, pad_arg, gy, pr, gr, gi, pw_d, dir_hb, rb, gl[0], gl[1], vp_d,
            *shape, dir_hb.stride(0), rb.stride(0), vp.stride(0), 0, HAS_GLAST=glast, **common,
        )  # fmt: skip
        _tc_bwd_out[sh.grid](
            x, pad_arg, gy, pr, gr, gi, pw_d, dir_hb, r0, h0_out[0], h0_out[1], gb[:, row0:], vp_d, gom,
            *shape, dir_hb.stride(0), r0.stride(0), gb.stride(0), vp.stride(0), 0,
            HAS_H0=g_h0 is not None, OMEGA=omega_grads, **common,
        )  # fmt: skip

    if bidirectional:
        dx32 = torch.empty(b, length, d, device=dev, dtype=f32)
        launch(dx32, dx32, 0, hb[0], False, True, False, None)
        dx = torch.empty_like(x)
        launch(dx32, dx, d, hb[1], True, False, True, None)
    else:
        dx = torch.empty_like(x)
        launch(dx, dx, 0, hb[0], False, True, False, gh0 if has_h0 else None)
    g_p = torch.empty(rows, n, device=dev, dtype=f32)
    g_q = torch.empty(rows, n, 2, device=dev, dtype=f32)
    g_g = torch.empty(rows, n, 2, device=dev, dtype=f32)
    g_om = torch.empty(d, device=dev, dtype=f32)
    _tc_reduce[(rows,)](
        gb, vp, gom, cf.p, cf.qr, cf.qi, cf.gr, cf.gi, g_p, g_q, g_g, g_om, b, rows, n, d, sh.t,
        QS=cf.qs, GS=cf.gs, S=sh.s, BN=sh.bn, BL=sh.t, BITS=sh.bits, num_warps=4,
    )  # fmt: skip
    return dx, g_p, g_q, g_g, g_om, gh0[0], gh0[1]


# ----------------------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile, with fake implementations) and autograd
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op(
    "mega_suite::cema_tc_fwd",
    mutates_args=(),
    schema="(Tensor x, Tensor p, Tensor q_re, Tensor q_im, Tensor g_re, Tensor g_im, Tensor omega, Tensor? h0_re, "
    "Tensor? h0_im, Tensor? pad, bool bidirectional, int chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _tc_fwd_op(x, p, q_re, q_im, g_re, g_im, omega, h0_re, h0_im, pad, bidirectional, chunk):
    return _tc_forward(x, p, q_re, q_im, g_re, g_im, omega, h0_re, h0_im, pad, bidirectional, chunk)


@_tc_fwd_op.register_fake
def _(x, p, q_re, q_im, g_re, g_im, omega, h0_re, h0_im, pad, bidirectional, chunk):
    b, length, d = x.shape
    n = p.shape[1]
    ng = triton.cdiv(triton.cdiv(length, chunk), ROWS)
    f32 = torch.float32
    return (
        x.new_empty(x.shape),
        x.new_empty(b, d, n, dtype=f32),
        x.new_empty(b, d, n, dtype=f32),
        x.new_empty(2 if bidirectional else 1, 2, b, ng, d, n, dtype=f32),
        x.new_empty(2, b, d, n, dtype=f32),
    )


@torch.library.custom_op(
    "mega_suite::cema_tc_bwd",
    mutates_args=(),
    schema="(Tensor gy, Tensor? gh_re, Tensor? gh_im, Tensor x, Tensor p, Tensor q_re, Tensor q_im, Tensor g_re, "
    "Tensor g_im, Tensor omega, Tensor? pad, Tensor hb, Tensor hs, bool bidirectional, bool has_h0, int chunk) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _tc_bwd_op(
    gy, gh_re, gh_im, x, p, q_re, q_im, g_re, g_im, omega, pad, hb, hs, bidirectional, has_h0, chunk
):
    return _tc_backward(
        gy, gh_re, gh_im, x, p, q_re, q_im, g_re, g_im, omega, pad, hb, hs, bidirectional, has_h0, chunk
    )


@_tc_bwd_op.register_fake
def _(gy, gh_re, gh_im, x, p, q_re, q_im, g_re, g_im, omega, pad, hb, hs, bidirectional, has_h0, chunk):
    b, _, d = x.shape
    rows, n = p.shape
    f32 = torch.float32
    h0 = lambda: x.new_empty((b, d, n) if has_h0 and not bidirectional else (0,), dtype=f32)
    return (x.new_empty(x.shape), p.new_empty(rows, n, dtype=f32), p.new_empty(rows, n, 2, dtype=f32),
            p.new_empty(rows, n, 2, dtype=f32), omega.new_empty(omega.shape, dtype=f32), h0(), h0())  # fmt: skip


# The interface of ``kernels.cema.triton.CEMAFunction`` over the tensor-core ops (hb, hs: the saved states).
CEMATensorCoreFunction = cema_autograd(
    "CEMATensorCoreFunction", torch.ops.mega_suite.cema_tc_fwd, torch.ops.mega_suite.cema_tc_bwd
)


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
    """Complex EMA by chunked GEMMs; the contract of ``kernels.cema.triton.cema`` (x float32 / float16 /
    bfloat16, math and state float32). ``chunk_size``: steps per chunk, one of ``CHUNKS`` (None: 64, or less
    for a short sequence). Returns y [B, L, D] in x's dtype and h_last [B, D, N] complex64 or None."""
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
    y, hl_re, hl_im = CEMATensorCoreFunction.apply(
        x, p, _interleaved(q), _interleaved(gamma), omega, h0_re, h0_im, pad, bidirectional,
        resolve_chunk(length, chunk_size),
    )  # fmt: skip
    return y, (torch.complex(hl_re, hl_im) if return_state else None)


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
    """CEMA from the raw parameters without any complex tensor: the coefficient kernel
    (``kernels.cema.triton.cema_coefficients_real``), then the GEMM form. Returns y [B, L, D] in x's dtype."""
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
    chunk = resolve_chunk(x.shape[1], chunk_size)
    y, _, _ = CEMATensorCoreFunction.apply(x, p, q, g, omega, None, None, pad, bidirectional, chunk)
    return y
