"""Fused TimestepNorm in Triton (docs/architecture.md#timestepnorm): causal group statistics with a carried (count, mean, var) state.

For batch row b, group g (d_g features) and valid step t, with n_t the number of valid steps so far
(including the carried count):

    M_t, V_t = mean and population variance of every element of the group over all valid steps <= t
    y_t      = (x_t - M_t) / sqrt(V_t + eps) * (1 + weight) + bias          (padding: y_t = 0)

The time axis is cut into tiles of BT steps, the features into blocks of GB whole groups; one program owns
(group block, tile, batch row), the group block varying fastest, so neighbouring programs read neighbouring
bytes of the same rows (each tile row is GB * d_g contiguous features). Tiles are tied together by their
start states, a Chan/Welford merge of per-tile (count, mean, M2) scanned over the tiles in float32 (docs/architecture.md#timestepnorm).

forward
  1. ``_fwd_tile_stats`` per tile and group: valid count k, mean (as hi + lo, float32 pair) and M2, the
                         sum over its valid steps of (variance + squared deviation of the step mean), in
                         "step units" (M2 / n is the variance). Statistics are taken of x - r with r the
                         first valid step's mean (exact: Sterbenz), so inputs with a large mean (~N(100, 1))
                         lose nothing to cancellation.
  2. ``_fwd_tile_scan``  per (group, row): the incoming state merged with the tiles in order
                         (``tl.associative_scan`` of ``_chan`` over blocks of tiles, the carry between blocks);
                         in place: tile summaries [B, G, tiles, 4] -> tile start states. Also the final state,
                         the count, and a per-(b, g) constant c (the final mean's hi part) near every running
                         mean.
  3. ``_fwd_output``     per tile: per-step running statistics from the start state and in-tile prefix sums
                         of shifted quantities (relative to r = hi), then y; saves per step M_t - c and
                         rstd_t [B, L, G, 2] and 1 / n_t [B, L] for the backward.
The mean is a float32 pair because its rounding would otherwise accumulate over the merges: the pair keeps
the merged mean to ~1e-14 relative, and M_t - c (not M_t) is what the backward keeps.

backward, with gŷ = gy (1 + weight), ŷ = (x - M) rstd, per valid step t:
    gM_t = -rstd_t Σ_f gŷ_tf,   gV_t = -rstd_t² / 2 Σ_f gŷ_tf ŷ_tf
and since ∂M_t/∂x_sf = 1/(n_t d_g), ∂V_t/∂x_sf = 2 (x_sf - M_t)/(n_t d_g) for every valid s <= t:
    dx_sf = rstd_s gŷ_sf + (A_s + 2 B_s (x_sf - c)) / d_g,
    A_s = Σ_{t>=s} (gM_t - 2 gV_t (M_t - c)) / n_t,   B_s = Σ_{t>=s} gV_t / n_t
The cotangents of the returned mean / var enter as one more step after the last, with n = final count.
The incoming state gets g_mean0 = n_0 (A_0 + 2 (mean0 - c) B_0), g_var0 = n_0 B_0.
  4. ``_bwd_tile_sums``  per tile (a few tiles per program): Σ_t of the two summands (A, B) over the tile,
                         from the saved statistics (no running statistics recomputed); and the partial
                         Σ gy ŷ, Σ gy per feature for dweight, dbias over the program's tiles.
  5. ``_bwd_tile_scan``  per (group, row): reverse exclusive sums over tiles -> the (A, B) carried into each
                         tile (in place), the incoming state's gradients; further programs of the same launch
                         sum the dweight / dbias partials in a fixed order.
  6. ``_bwd_dx``         per tile: in-tile reverse cumulative sums + carry -> dx.
Statistics are float32 whatever x's dtype. No atomics: runs are bitwise reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["TimestepNormFunction", "timestep_norm"]

NormState = tuple[Tensor, Tensor, Tensor]  # count [B] int64, mean [B, G], var [B, G]


# ----------------------------------------------------------------------------------------------- helpers


@triton.jit
def _load_tile(x_ptr, pad_ptr, b, c, gb, L, D, G, DG,
               BT: tl.constexpr, GB: tl.constexpr, BF: tl.constexpr, HAS_PAD: tl.constexpr):  # fmt: skip
    """The [BT, GB, BF] tile of group block gb (float32, zero outside), its rows b * L + t, valid steps,
    element mask, offsets, groups and group mask."""
    offs_t = c * BT + tl.arange(0, BT)
    groups = gb * GB + tl.arange(0, GB)
    offs_f = tl.arange(0, BF)
    in_t = offs_t < L
    rows = b.to(tl.int64) * L + offs_t
    g_ok = groups < G
    cols = groups[:, None] * DG + offs_f[None, :]  # [GB, BF]
    col_ok = g_ok[:, None] & (offs_f[None, :] < DG)
    elem = in_t[:, None, None] & col_ok[None, :, :]
    offs = rows[:, None, None] * D + cols[None, :, :]
    x = tl.load(x_ptr + offs, mask=elem, other=0.0).to(tl.float32)
    valid = in_t
    if HAS_PAD:
        valid = valid & (tl.load(pad_ptr + rows, mask=in_t, other=1) == 0)
    return x, rows, in_t, valid, elem, offs, groups, g_ok, cols, col_ok


@triton.jit
def _first_valid_mean(x, valid, DG, BT: tl.constexpr):
    """[GB] mean of each group at the tile's first valid step (0 if none): the shift that makes x - r exact."""
    idx = tl.arange(0, BT)
    first = tl.min(tl.where(valid, idx, BT), axis=0)
    return tl.sum(tl.where((idx == first)[:, None], tl.sum(x, axis=2), 0.0), axis=0) / DG


@triton.jit
def _step_stats(x, r, elem, DG):
    """Per step and group: x - r, the mean offset delta = mean(x) - r and the population variance."""
    xs = tl.where(elem, x - r[None, :, None], 0.0)
    delta = tl.sum(xs, axis=2) / DG
    dev = tl.where(elem, xs - delta[:, :, None], 0.0)
    return xs, delta, tl.sum(dev * dev, axis=2) / DG


@triton.jit
def _two_sum(a, b):
    """(s, e) with s = fl(a + b) and s + e = a + b exactly."""
    s = a + b
    bv = s - a
    return s, (a - (s - bv)) + (b - bv)


@triton.jit
def _chan(na, ha, la, ma, nb, hb, lb, mb):
    """Chan's merge of two (count, mean hi, mean lo, M2) summaries, a before b; the mean as a float32 pair."""
    n = na + nb
    f = nb / tl.maximum(n, 1.0)
    d = (hb - ha) + (lb - la)
    s, err = _two_sum(ha, d * f)
    h, l = _two_sum(s, la + err)
    m = ma + mb + d * d * na * f
    first = na == 0.0
    return n, tl.where(first, hb, h), tl.where(first, lb, l), tl.where(first, mb, m)


@triton.jit
def _last_row(t, idx, SB: tl.constexpr):
    """Element SB - 1 of an [SB] tensor (exact: the others add zeros)."""
    return tl.sum(tl.where(idx == SB - 1, t, 0.0), axis=0)


# ----------------------------------------------------------------------------------------------- forward


@triton.jit
def _fwd_tile_stats(
    x_ptr, pad_ptr, st_ptr, L, D, G, NC, DG,
    HAS_PAD: tl.constexpr, BT: tl.constexpr, GB: tl.constexpr, BF: tl.constexpr,
):  # fmt: skip
    """st[b, c, g] = (valid count k, mean hi, mean lo, M2) of the tile's valid steps."""
    gb, c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x, _, _, valid, elem, _, groups, g_ok, _, _ = _load_tile(
        x_ptr, pad_ptr, b, c, gb, L, D, G, DG, BT, GB, BF, HAS_PAD
    )
    r = _first_valid_mean(x, valid, DG, BT)
    _, delta, var = _step_stats(x, r, elem, DG)
    w = valid.to(tl.float32)[:, None]
    k = tl.sum(w * tl.full(delta.shape, 1.0, tl.float32), axis=0)
    e = tl.sum(w * delta, axis=0) / tl.maximum(k, 1.0)
    dd = delta - e[None, :]
    m2 = tl.sum(w * (var + dd * dd), axis=0)
    hi, lo = _two_sum(r, e)
    sp = st_ptr + ((b.to(tl.int64) * G + groups) * NC + c) * 4
    tl.store(sp, k, mask=g_ok)
    tl.store(sp + 1, hi, mask=g_ok)
    tl.store(sp + 2, lo, mask=g_ok)
    tl.store(sp + 3, m2, mask=g_ok)


@triton.jit
def _fwd_tile_scan(
    st_ptr, count0_ptr, mean0_ptr, var0_ptr, mean_ptr, var_ptr, count_ptr, shift_ptr, G, NC,
    HAS_STATE: tl.constexpr, SB: tl.constexpr,
):  # fmt: skip
    """Per (group, row), in place: tile summaries -> tile start states (the incoming state merged with every
    earlier tile), SB tiles at a time. Out: the final mean, variance [B, G] and count [B], and the shift
    (c, final mean - c) [B, G, 2]."""
    g, b = tl.program_id(0), tl.program_id(1)
    op = b.to(tl.int64) * G + g
    if HAS_STATE:
        count0 = tl.load(count0_ptr + b)
        mean0 = tl.load(mean0_ptr + op)
        var0 = tl.load(var0_ptr + op)
    else:
        count0 = tl.zeros([], dtype=tl.int64)
        mean0 = tl.zeros([], dtype=tl.float32)
        var0 = tl.full([], 1.0, tl.float32)
    cn = count0.to(tl.float32)
    ch = tl.where(cn > 0, mean0, 0.0)
    cl = tl.zeros([], dtype=tl.float32)
    cm = cn * tl.where(cn > 0, var0, 0.0)
    seen = tl.zeros([], dtype=tl.float32)  # valid steps of this segment
    idx = tl.arange(0, SB)
    base = st_ptr + op * NC * 4
    for blk in range(tl.cdiv(NC, SB)):
        tiles = blk * SB + idx
        ok = tiles < NC
        sp = base + tiles * 4
        k = tl.load(sp, mask=ok, other=0.0)
        h = tl.load(sp + 1, mask=ok, other=0.0)
        l = tl.load(sp + 2, mask=ok, other=0.0)
        m = tl.load(sp + 3, mask=ok, other=0.0)
        seen += tl.sum(k, axis=0)
        row0 = (idx == 0) & ok  # the block's first tile starts from the carry
        tl.store(sp, cn + 0.0 * k, mask=row0)
        tl.store(sp + 1, ch + 0.0 * k, mask=row0)
        tl.store(sp + 2, cl + 0.0 * k, mask=row0)
        tl.store(sp + 3, cm + 0.0 * k, mask=row0)
        # the carry merged into the block's first tile, then an inclusive scan over the block
        n1, h1, l1, m1 = _chan(cn, ch, cl, cm, k, h, l, m)
        is0 = idx == 0
        k, h, l, m = tl.where(is0, n1, k), tl.where(is0, h1, h), tl.where(is0, l1, l), tl.where(is0, m1, m)
        k, h, l, m = tl.associative_scan((k, h, l, m), 0, _chan)
        nxt = (idx < SB - 1) & (tiles + 1 < NC)  # tile t's inclusive state starts tile t + 1
        tl.store(sp + 4, k, mask=nxt)
        tl.store(sp + 5, h, mask=nxt)
        tl.store(sp + 6, l, mask=nxt)
        tl.store(sp + 7, m, mask=nxt)
        cn, ch, cl, cm = (
            _last_row(k, idx, SB),
            _last_row(h, idx, SB),
            _last_row(l, idx, SB),
            _last_row(m, idx, SB),
        )
    keep = seen == 0  # no valid step: the incoming state passes through unchanged
    tl.store(mean_ptr + op, tl.where(keep, mean0, ch + cl))
    tl.store(var_ptr + op, tl.where(keep, var0, cm / tl.maximum(cn, 1.0)))
    tl.store(shift_ptr + op * 2, tl.where(keep, mean0, ch))
    tl.store(shift_ptr + op * 2 + 1, tl.where(keep, 0.0, cl))
    if g == 0:
        tl.store(count_ptr + b, count0 + seen.to(tl.int64))


@triton.jit
def _fwd_output(
    x_ptr, pad_ptr, w_ptr, b_ptr, st_ptr, shift_ptr, y_ptr, stats_ptr, inv_n_ptr, L, D, G, NC, DG, eps,
    HAS_PAD: tl.constexpr, BT: tl.constexpr, GB: tl.constexpr, BF: tl.constexpr,
):  # fmt: skip
    gb, c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x, rows, in_t, valid, elem, offs, groups, g_ok, cols, col_ok = _load_tile(
        x_ptr, pad_ptr, b, c, gb, L, D, G, DG, BT, GB, BF, HAS_PAD
    )
    b64 = b.to(tl.int64)
    sp = st_ptr + ((b64 * G + groups) * NC + c) * 4
    n0 = tl.load(sp, mask=g_ok, other=0.0)
    hi = tl.load(sp + 1, mask=g_ok, other=0.0)
    lo = tl.load(sp + 2, mask=g_ok, other=0.0)
    m20 = tl.load(sp + 3, mask=g_ok, other=0.0)
    has_prior = n0 > 0
    r = tl.where(has_prior, hi, _first_valid_mean(x, valid, DG, BT))
    m0 = tl.where(has_prior, lo, 0.0)  # start mean relative to r
    xs, delta, var = _step_stats(x, r, elem, DG)
    w = valid.to(tl.float32)[:, None]
    k = tl.cumsum(w * tl.full(delta.shape, 1.0, tl.float32), axis=0)
    c1 = tl.cumsum(w * delta, axis=0)
    c2 = tl.cumsum(w * (var + delta * delta), axis=0)
    n = n0[None, :] + k
    inv_n = 1.0 / tl.maximum(n, 1.0)
    e = (n0 * m0 + c1) * inv_n  # M_t - r
    # n V = M2_0 + n0 m0² + Σ (var_s + δ_s²) - n E²   (sums of squares about r)
    v = tl.maximum((m20 + n0 * m0 * m0 + c2) * inv_n - e * e, 0.0)
    rstd = 1.0 / tl.sqrt(v + eps)
    scale = 1.0 + tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = (xs - e[:, :, None]) * rstd[:, :, None] * scale[None, :, :] + bias[None, :, :]
    y = tl.where(valid[:, None, None], y, 0.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=elem)
    cs = tl.load(shift_ptr + (b64 * G + groups) * 2, mask=g_ok, other=0.0)
    sp = stats_ptr + (rows[:, None] * G + groups[None, :]) * 2
    smask = in_t[:, None] & g_ok[None, :]
    tl.store(sp, (r - cs)[None, :] + e, mask=smask)  # M_t - c
    tl.store(sp + 1, rstd, mask=smask)
    if gb == 0:
        tl.store(inv_n_ptr + rows, tl.max(tl.where(g_ok[None, :], inv_n, 0.0), axis=1), mask=in_t)


# ---------------------------------------------------------------------------------------------- backward


@triton.jit
def _bwd_terms(x_ptr, pad_ptr, gy_ptr, w_ptr, stats_ptr, inv_n_ptr, shift_ptr, b, c, gb, L, D, G, DG,
               BT: tl.constexpr, GB: tl.constexpr, BF: tl.constexpr, HAS_PAD: tl.constexpr):  # fmt: skip
    """Per step of tile c: the summands a_t = (gM - 2 gV (M - c)) / n, b_t = gV / n and what dx needs."""
    x, rows, in_t, valid, elem, offs, groups, g_ok, cols, col_ok = _load_tile(
        x_ptr, pad_ptr, b, c, gb, L, D, G, DG, BT, GB, BF, HAS_PAD
    )
    sp = stats_ptr + (rows[:, None] * G + groups[None, :]) * 2
    smask = in_t[:, None] & g_ok[None, :]
    mc = tl.load(sp, mask=smask, other=0.0)  # M_t - c
    rstd = tl.load(sp + 1, mask=smask, other=0.0)
    inv_n = tl.load(inv_n_ptr + rows, mask=in_t, other=0.0)[:, None]
    cs = tl.load(shift_ptr + (b.to(tl.int64) * G + groups) * 2, mask=g_ok, other=0.0)
    xc = tl.where(elem, x - cs[None, :, None], 0.0)  # x - c
    scale = 1.0 + tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + offs, mask=elem, other=0.0).to(tl.float32)
    gy = tl.where(valid[:, None, None], gy, 0.0)
    yhat = tl.where(elem, (xc - mc[:, :, None]) * rstd[:, :, None], 0.0)
    gyhat = gy * scale[None, :, :]
    g_mean = -rstd * tl.sum(gyhat, axis=2)
    g_var = -0.5 * rstd * rstd * tl.sum(gyhat * yhat, axis=2)
    ok = valid[:, None] & g_ok[None, :]
    a = tl.where(ok, (g_mean - 2.0 * g_var * mc) * inv_n, 0.0)
    bb = tl.where(ok, g_var * inv_n, 0.0)
    return a, bb, xc, rstd, gy, gyhat, yhat, valid, elem, offs, groups, g_ok, cols, col_ok


@triton.jit
def _bwd_tile_sums(
    x_ptr, pad_ptr, gy_ptr, w_ptr, stats_ptr, inv_n_ptr, shift_ptr, sums_ptr, part_ptr,
    L, D, G, NC, NP, DG, TPP,
    HAS_PAD: tl.constexpr, BT: tl.constexpr, GB: tl.constexpr, BF: tl.constexpr,
):  # fmt: skip
    """sums[b, c, g] = (Σ_t a_t, Σ_t b_t) over each of TPP tiles; part[b, p] = (Σ gy ŷ, Σ gy) per feature
    over them (dweight, dbias partials)."""
    gb, p, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b64 = b.to(tl.int64)
    groups = gb * GB + tl.arange(0, GB)
    g_ok = groups < G
    cols = groups[:, None] * DG + tl.arange(0, BF)[None, :]
    col_ok = g_ok[:, None] & (tl.arange(0, BF)[None, :] < DG)
    acc_w = tl.zeros([GB, BF], dtype=tl.float32)
    acc_b = tl.zeros([GB, BF], dtype=tl.float32)
    for i in range(TPP):
        c = p * TPP + i
        a, bb, _, _, gy, _, yhat, _, _, _, _, _, _, _ = _bwd_terms(
            x_ptr, pad_ptr, gy_ptr, w_ptr, stats_ptr, inv_n_ptr, shift_ptr, b, c, gb, L, D, G, DG,
            BT, GB, BF, HAS_PAD,
        )  # fmt: skip
        acc_w += tl.sum(gy * yhat, axis=0)
        acc_b += tl.sum(gy, axis=0)
        sp = sums_ptr + ((b64 * G + groups) * NC + c) * 2
        ok = g_ok & ((groups * 0 + c) < NC)
        tl.store(sp, tl.sum(a, axis=0), mask=ok)
        tl.store(sp + 1, tl.sum(bb, axis=0), mask=ok)
    pp = part_ptr + (b64 * NP + p) * 2 * D + cols
    tl.store(pp, acc_w, mask=col_ok)
    tl.store(pp + D, acc_b, mask=col_ok)


@triton.jit
def _bwd_tile_scan(
    sums_ptr, gm_ptr, gv_ptr, count_ptr, shift_ptr, count0_ptr, mean0_ptr, gmean0_ptr, gvar0_ptr,
    part_ptr, dw_ptr, db_ptr, B, D, G, NC, ROWS,
    HAS_GM: tl.constexpr, HAS_GV: tl.constexpr, HAS_STATE: tl.constexpr,
    SB: tl.constexpr, RR: tl.constexpr, RB: tl.constexpr,
):  # fmt: skip
    """Programs [0, B * G), one per (row, group): in place, tile sums -> the (A, B) carried into each tile from
    the right, plus the returned state's cotangents; out, the incoming state's gradients. Programs after
    them: dweight, dbias = Σ over the ROWS partials [ROWS, 2, D], RR rows at a time, RB features each (a
    fixed order: deterministic)."""
    pid = tl.program_id(0)
    if pid < B * G:
        b, g = pid // G, pid % G
        op = b.to(tl.int64) * G + g
        nf = tl.load(count_ptr + b).to(tl.float32)
        inv_nf = tl.where(nf > 0, 1.0 / tl.maximum(nf, 1.0), 0.0)
        cs = tl.load(shift_ptr + op * 2)
        lo_f = tl.load(shift_ptr + op * 2 + 1)  # final mean - c
        gm = tl.zeros([], dtype=tl.float32)
        gv = tl.zeros([], dtype=tl.float32)
        if HAS_GM:
            gm = tl.load(gm_ptr + op)
        if HAS_GV:
            gv = tl.load(gv_ptr + op)
        ca = (gm - 2.0 * gv * lo_f) * inv_nf  # the returned state: one more step after the last
        cb = gv * inv_nf
        idx = tl.arange(0, SB)
        base = sums_ptr + op * NC * 2
        for blk in range(tl.cdiv(NC, SB)):
            tiles = NC - (blk + 1) * SB + idx  # right to left
            ok = tiles >= 0
            sp = base + tiles * 2
            a = tl.load(sp, mask=ok, other=0.0)
            bb = tl.load(sp + 1, mask=ok, other=0.0)
            last = (idx == SB - 1) & ok
            tl.store(sp, ca + 0.0 * a, mask=last)
            tl.store(sp + 1, cb + 0.0 * a, mask=last)
            ia = tl.cumsum(a, axis=0, reverse=True) + ca
            ib = tl.cumsum(bb, axis=0, reverse=True) + cb
            prev = (idx > 0) & (tiles > 0)  # tile t's sum (and all after it) ends tile t - 1
            tl.store(sp - 2, ia, mask=prev)
            tl.store(sp - 1, ib, mask=prev)
            ca = tl.sum(tl.where(idx == 0, ia, 0.0), axis=0)
            cb = tl.sum(tl.where(idx == 0, ib, 0.0), axis=0)
        if HAS_STATE:
            n0 = tl.load(count0_ptr + b).to(tl.float32)
            mean0 = tl.load(mean0_ptr + op)
            tl.store(gmean0_ptr + op, tl.where(nf == 0, gm, n0 * (ca + 2.0 * (mean0 - cs) * cb)))
            tl.store(gvar0_ptr + op, tl.where(nf == 0, gv, n0 * cb))
    else:
        cols = (pid - B * G) * RB + tl.arange(0, RB)
        c_ok = cols < D
        rows = tl.arange(0, RR)
        acc_w = tl.zeros([RB], dtype=tl.float32)
        acc_b = tl.zeros([RB], dtype=tl.float32)
        for r0 in range(0, ROWS, RR):
            mask = ((r0 + rows) < ROWS)[:, None] & c_ok[None, :]
            pp = part_ptr + (r0 + rows)[:, None].to(tl.int64) * 2 * D + cols[None, :]
            acc_w += tl.sum(tl.load(pp, mask=mask, other=0.0), axis=0)
            acc_b += tl.sum(tl.load(pp + D, mask=mask, other=0.0), axis=0)
        tl.store(dw_ptr + cols, acc_w, mask=c_ok)
        tl.store(db_ptr + cols, acc_b, mask=c_ok)


@triton.jit
def _bwd_dx(
    x_ptr, pad_ptr, gy_ptr, w_ptr, stats_ptr, inv_n_ptr, shift_ptr, car_ptr, dx_ptr, L, D, G, NC, DG,
    HAS_PAD: tl.constexpr, BT: tl.constexpr, GB: tl.constexpr, BF: tl.constexpr,
):  # fmt: skip
    gb, c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    a, bb, xc, rstd, _, gyhat, _, valid, elem, offs, groups, g_ok, _, _ = _bwd_terms(
        x_ptr, pad_ptr, gy_ptr, w_ptr, stats_ptr, inv_n_ptr, shift_ptr, b, c, gb, L, D, G, DG,
        BT, GB, BF, HAS_PAD,
    )  # fmt: skip
    cp = car_ptr + ((b.to(tl.int64) * G + groups) * NC + c) * 2
    big_a = tl.cumsum(a, axis=0, reverse=True) + tl.load(cp, mask=g_ok, other=0.0)[None, :]
    big_b = tl.cumsum(bb, axis=0, reverse=True) + tl.load(cp + 1, mask=g_ok, other=0.0)[None, :]
    dx = rstd[:, :, None] * gyhat + (big_a[:, :, None] + 2.0 * big_b[:, :, None] * xc) / DG
    dx = tl.where(valid[:, None, None], dx, 0.0)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=elem)


# --------------------------------------------------------------------------------------------- launchers


def _config(length: int, group_width: int, num_groups: int, block_t: int | None):
    """(BT steps per tile, GB groups per tile, BF padded group width, warps): tiles of up to 4096 elements,
    as wide as 512 features (whole groups) allow."""
    bf = triton.next_power_of_2(group_width)
    gb = max(1, min(triton.next_power_of_2(num_groups), 512 // bf))
    if block_t is None:
        block_t = max(1, min(64, 4096 // (gb * bf)))
    block_t = min(triton.next_power_of_2(block_t), triton.next_power_of_2(max(length, 1)))
    size = block_t * gb * bf
    warps = 8 if size >= 4096 else 4 if size >= 1024 else (2 if size >= 256 else 1)
    return block_t, gb, bf, warps


def _scan_config(tiles: int) -> int:
    """Tiles per block of the scans over tiles (one program per row and group)."""
    return min(triton.next_power_of_2(tiles), 512)


def _reduce_block(d: int) -> tuple[int, int]:
    """(features per program, partial rows per step) of the dweight / dbias sum."""
    rb = min(triton.next_power_of_2(d), 128)
    return rb, max(1, 2048 // rb)


def _tiles_per_program(tiles: int, programs: int) -> int:
    """Tiles per backward-sums program: fewer dweight / dbias partials, while >= ~1024 programs remain."""
    return max(1, min(16, tiles, programs // 1024))


def _forward(x, weight, bias, count0, mean0, var0, pad, groups: int, eps: float, block_t):
    """Launches tile statistics -> scan over tiles -> outputs. Returns y, the final mean, variance, count,
    and what the backward keeps: per-step (M_t - c, rstd_t) [B, L, G, 2], 1 / n_t [B, L] and the shift
    (c, final mean - c) [B, G, 2]."""
    b, length, d = x.shape
    dg = d // groups
    bt, gb, bf, warps = _config(length, dg, groups, block_t)
    nc = triton.cdiv(length, bt)
    grid = (triton.cdiv(groups, gb), nc, b)
    dev, f32 = x.device, torch.float32
    pad_arg = pad if pad is not None else x
    has_state = count0.numel() > 0
    starts = torch.empty(b, groups, nc, 4, device=dev, dtype=f32)
    _fwd_tile_stats[grid](
        x, pad_arg, starts, length, d, groups, nc, dg,
        HAS_PAD=pad is not None, BT=bt, GB=gb, BF=bf, num_warps=warps,
    )  # fmt: skip
    mean = torch.empty(b, groups, device=dev, dtype=f32)
    var = torch.empty(b, groups, device=dev, dtype=f32)
    count = torch.empty(b, device=dev, dtype=torch.int64)
    shift = torch.empty(b, groups, 2, device=dev, dtype=f32)
    _fwd_tile_scan[(groups, b)](
        starts, count0 if has_state else count, mean0 if has_state else mean, var0 if has_state else var,
        mean, var, count, shift, groups, nc,
        HAS_STATE=has_state, SB=_scan_config(nc), num_warps=4,
    )  # fmt: skip
    y = torch.empty_like(x)
    stats = torch.empty(b, length, groups, 2, device=dev, dtype=f32)
    inv_n = torch.empty(b, length, device=dev, dtype=f32)
    _fwd_output[grid](
        x, pad_arg, weight, bias, starts, shift, y, stats, inv_n, length, d, groups, nc, dg, eps,
        HAS_PAD=pad is not None, BT=bt, GB=gb, BF=bf, num_warps=warps,
    )  # fmt: skip
    return y, mean, var, count, stats, inv_n, shift


def _backward(x, pad, weight, gy, g_mean, g_var, count0, mean0, count, stats, inv_n, shift, groups, block_t):
    """Launches tile sums (+ dweight / dbias partials) -> reverse scan over tiles (+ the partials' sum) ->
    dx. Returns dx, dweight, dbias and the incoming state's gradients (float32; empty without a state)."""
    b, length, d = x.shape
    dg = d // groups
    bt, gb, bf, warps = _config(length, dg, groups, block_t)
    nc = triton.cdiv(length, bt)
    ngb = triton.cdiv(groups, gb)
    tpp = _tiles_per_program(nc, ngb * nc * b)
    n_part = triton.cdiv(nc, tpp)
    dev, f32 = x.device, torch.float32
    pad_arg = pad if pad is not None else x
    has_state = count0.numel() > 0
    sums = torch.empty(b, groups, nc, 2, device=dev, dtype=f32)
    part = torch.empty(b * n_part, 2, d, device=dev, dtype=f32)
    _bwd_tile_sums[(ngb, n_part, b)](
        x, pad_arg, gy, weight, stats, inv_n, shift, sums, part, length, d, groups, nc, n_part, dg, tpp,
        HAS_PAD=pad is not None, BT=bt, GB=gb, BF=bf, num_warps=warps,
    )  # fmt: skip
    g_mean0 = torch.empty(mean0.shape, device=dev, dtype=f32)
    g_var0 = torch.empty(mean0.shape, device=dev, dtype=f32)
    dweight = torch.empty(d, device=dev, dtype=f32)
    dbias = torch.empty(d, device=dev, dtype=f32)
    rb, rr = _reduce_block(d)
    _bwd_tile_scan[(b * groups + triton.cdiv(d, rb),)](
        sums, g_mean if g_mean is not None else sums, g_var if g_var is not None else sums, count, shift,
        count0 if has_state else count, mean0 if has_state else shift, g_mean0, g_var0, part, dweight, dbias,
        b, d, groups, nc, b * n_part,
        HAS_GM=g_mean is not None, HAS_GV=g_var is not None, HAS_STATE=has_state, SB=_scan_config(nc),
        RR=rr, RB=rb, num_warps=4,
    )  # fmt: skip
    dx = torch.empty_like(x)
    _bwd_dx[(ngb, nc, b)](
        x, pad_arg, gy, weight, stats, inv_n, shift, sums, dx, length, d, groups, nc, dg,
        HAS_PAD=pad is not None, BT=bt, GB=gb, BF=bf, num_warps=warps,
    )  # fmt: skip
    return dx, dweight, dbias, g_mean0, g_var0


# ----------------------------------------------------------------------------------------------------------
# Custom ops (torch.compile sees two opaque calls with known output shapes, no graph break) and autograd
# ----------------------------------------------------------------------------------------------------------


def _f32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def _tsn_forward(x, weight, bias, mean0, var0, count0, pad, num_groups, eps, block_t):
    """(y, final mean, variance [B, G] float32, final count [B] int64, then for the backward: per-step
    statistics [B, L, G, 2], 1 / n_t [B, L] and the shift [B, G, 2]). Without a carried state mean0, var0,
    count0 are empty."""
    return _forward(
        x.contiguous(), weight.contiguous(), bias.contiguous(), count0, _f32(mean0).contiguous(),
        _f32(var0).contiguous(), pad, num_groups, eps, block_t,
    )  # fmt: skip


def _tsn_backward(gy, g_mean, g_var, x, pad, weight, count0, mean0, count, stats, inv_n, shift, num_groups, eps,
                  block_t):  # fmt: skip
    """(dx, dweight, dbias float32 [D], the incoming mean's and variance's gradients float32 [B, G], empty
    without a carried state)."""
    f = lambda t: None if t is None else _f32(t).contiguous()
    return _backward(
        x.contiguous(), pad, weight.contiguous(), gy.contiguous(), f(g_mean), f(g_var), count0,
        _f32(mean0).contiguous(), count, stats, inv_n, shift, num_groups, block_t,
    )  # fmt: skip


@torch.library.custom_op(
    "mega_suite::timestep_norm_fwd",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor bias, Tensor mean0, Tensor var0, Tensor count0, Tensor? pad, "
    "int num_groups, float eps, int? block_t) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _tsn_fwd_op(x, weight, bias, mean0, var0, count0, pad, num_groups, eps, block_t):
    return _tsn_forward(x, weight, bias, mean0, var0, count0, pad, num_groups, eps, block_t)


@_tsn_fwd_op.register_fake
def _(x, weight, bias, mean0, var0, count0, pad, num_groups, eps, block_t):
    b, length, _ = x.shape
    f32 = torch.float32
    return (
        x.new_empty(x.shape), x.new_empty(b, num_groups, dtype=f32), x.new_empty(b, num_groups, dtype=f32),
        x.new_empty(b, dtype=torch.int64), x.new_empty(b, length, num_groups, 2, dtype=f32),
        x.new_empty(b, length, dtype=f32), x.new_empty(b, num_groups, 2, dtype=f32),
    )  # fmt: skip


@torch.library.custom_op(
    "mega_suite::timestep_norm_bwd",
    mutates_args=(),
    schema="(Tensor gy, Tensor? g_mean, Tensor? g_var, Tensor x, Tensor? pad, Tensor weight, Tensor count0, "
    "Tensor mean0, Tensor count, Tensor stats, Tensor inv_n, Tensor shift, int num_groups, float eps, "
    "int? block_t) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _tsn_bwd_op(gy, g_mean, g_var, x, pad, weight, count0, mean0, count, stats, inv_n, shift, num_groups, eps,
                block_t):  # fmt: skip
    return _tsn_backward(
        gy, g_mean, g_var, x, pad, weight, count0, mean0, count, stats, inv_n, shift, num_groups, eps, block_t
    )


@_tsn_bwd_op.register_fake
def _(gy, g_mean, g_var, x, pad, weight, count0, mean0, count, stats, inv_n, shift, num_groups, eps, block_t):
    d = x.shape[2]
    f32 = torch.float32
    return (
        x.new_empty(x.shape), x.new_empty(d, dtype=f32), x.new_empty(d, dtype=f32),
        x.new_empty(mean0.shape, dtype=f32), x.new_empty(mean0.shape, dtype=f32),
    )  # fmt: skip


class TimestepNormFunction(torch.autograd.Function):
    """The kernels run inside two custom ops (``mega_suite::timestep_norm_fwd`` / ``_bwd``), so
    torch.compile keeps a block that uses them in one graph. Returns y, the final mean, variance and count."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean0, var0, count0, pad, num_groups, eps, block_t):
        y, mean, var, count, stats, inv_n, shift = torch.ops.mega_suite.timestep_norm_fwd(
            x, weight, bias, mean0, var0, count0, pad, num_groups, eps, block_t
        )
        ctx.save_for_backward(x, pad, weight, count0, mean0, count, stats, inv_n, shift)
        ctx.groups, ctx.eps, ctx.block_t = num_groups, eps, block_t
        ctx.dtypes = (weight.dtype, bias.dtype, mean0.dtype, var0.dtype)
        ctx.mark_non_differentiable(count)
        ctx.set_materialize_grads(False)
        return y, mean, var, count

    @staticmethod
    def backward(ctx, gy, g_mean, g_var, _):
        x, pad, weight, count0, mean0, count, stats, inv_n, shift = ctx.saved_tensors
        if gy is None:
            gy = torch.zeros_like(x)
        dx, dw, db, g_mean0, g_var0 = torch.ops.mega_suite.timestep_norm_bwd(
            gy, g_mean, g_var, x, pad, weight, count0, mean0, count, stats, inv_n, shift, ctx.groups,
            ctx.eps, ctx.block_t,
        )  # fmt: skip
        need = ctx.needs_input_grad
        grads = [
            g.to(dtype) if n else None
            for g, dtype, n in zip(
                (dw, db, g_mean0, g_var0), ctx.dtypes, (need[1], need[2], need[3], need[4])
            )
        ]
        return (dx, *grads, None, None, None, None, None)


def timestep_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    num_groups: int,
    eps: float = 1e-5,
    state: NormState | None = None,
    padding_mask: Tensor | None = None,
    block_t: int | None = None,
) -> tuple[Tensor, NormState]:
    """Causal group norm by the fused tiled kernels; same contract as the reference ``timestep_norm``.

    Args:
        x: [B, L, D] (float32 / float16 / bfloat16; statistics in float32).
        weight, bias: [D], applied as (1 + weight), bias.
        num_groups: G, dividing D.
        state: carried (count [B] int64, mean [B, G], var [B, G]) or None (count 0).
        padding_mask: [B, L] bool, True = padding; padded steps output 0 and leave the state unchanged.
        block_t: steps per tile (one program each); None picks one from the group width.

    Returns:
        y [B, L, D] in x's dtype, and the state after the last step (count [B] int64, mean, var [B, G]
        float32).
    """
    if x.dim() != 3:
        raise ValueError(f"expected x of shape [B, L, D], got {tuple(x.shape)}")
    b, length, d = x.shape
    if d % num_groups != 0:
        raise ValueError(f"model width D={d} is not divisible by num_groups={num_groups}")
    if weight.shape != (d,) or bias.shape != (d,):
        raise ValueError(
            f"norm weight and bias must be [{d}], got {tuple(weight.shape)}, {tuple(bias.shape)}"
        )
    if padding_mask is not None and padding_mask.shape != (b, length):
        raise ValueError(f"padding_mask must be [B, L] = {(b, length)}, got {tuple(padding_mask.shape)}")
    if state is None:  # empty: the kernels start from count 0 (no fill launched)
        count0 = x.new_empty(0, dtype=torch.int64)
        mean0, var0 = x.new_empty(0, dtype=torch.float32), x.new_empty(0, dtype=torch.float32)
    else:
        count0, mean0, var0 = state
        if length == 0:
            return x.clone(), (count0, mean0.to(torch.float32), var0.to(torch.float32))
    if length == 0:
        count = torch.zeros(b, dtype=torch.int64, device=x.device)
        mean = torch.zeros(b, num_groups, dtype=torch.float32, device=x.device)
        return x.clone(), (count, mean, torch.ones_like(mean))
    pad = None if padding_mask is None else padding_mask.to(torch.int8).contiguous()
    y, mean, var, count = TimestepNormFunction.apply(
        x, weight, bias, mean0, var0, count0, pad, num_groups, eps, block_t
    )
    return y, (count, mean, var)
