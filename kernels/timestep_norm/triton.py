"""Fused TimestepNorm in Triton (docs/architecture.md#timestepnorm): causal group statistics with a carried (count, mean, var) state.

For batch row b, group g (d_g features) and valid step t, with n_t the number of valid steps so far
(including the carried count):

    M_t, V_t = mean and population variance of every element of the group over all valid steps <= t
    y_t      = (x_t - M_t) / sqrt(V_t + eps) * (1 + weight) + bias          (padding: y_t = 0)

The time axis is cut into tiles of BT steps; one program owns (tile, group, batch row), so every tile
works in parallel, and tiles are tied together by their start states (docs/architecture.md#chunk-parallelism: a Welford merge):

forward
  1. ``_chunk_stats``  per tile: valid count k, mean r + e and variance v of its elements. Statistics are
                       taken of x - r with r the first valid step's mean (exact: Sterbenz), so inputs with
                       a large mean (~N(100, 1)) lose nothing to cancellation.
  2. ``_prefix``       (PyTorch, on the tiny [B, tiles, G] summaries, float64 sums after a shift, as in the
                       reference): the state at each tile start and the final state. The start mean goes to
                       the kernels as a float32 pair hi + lo, so no float32 rounding of M accumulates.
  3. ``_fwd_output``   per tile: per-step statistics merged into the start state with in-tile prefix sums
                       of shifted quantities (relative to r = hi), then y.

backward, with gŷ = gy (1 + weight), ŷ = (x - M) rstd, per valid step t:
    gM_t = -rstd_t Σ_f gŷ_tf,   gV_t = -rstd_t² / 2 Σ_f gŷ_tf ŷ_tf
and since ∂M_t/∂x_sf = 1/(n_t d_g), ∂V_t/∂x_sf = 2 (x_sf - M_t)/(n_t d_g) for every valid s <= t:
    dx_sf = rstd_s gŷ_sf + (A_s + 2 B_s (x_sf - c)) / d_g,
    A_s = Σ_{t>=s} (gM_t - 2 gV_t (M_t - c)) / n_t,   B_s = Σ_{t>=s} gV_t / n_t
(c a per-(b, g) constant near the means, for precision). The cotangents of the returned mean / var enter
as one more step after the last, with n = final count. The incoming state gets
    g_mean0 = n_0 (A_0 + 2 (mean0 - c) B_0),   g_var0 = n_0 B_0.
  4. ``_bwd_chunk``    per tile: Σ_t of the two summands (A, B) over the tile
  5. (PyTorch)         reverse exclusive cumulative sums over tiles -> the (A, B) carried into each tile
  6. ``_bwd_dx``       per tile: in-tile reverse cumulative sums + carry -> dx; partial Σ gy ŷ, Σ gy
                       per feature for dweight, dbias into a [B * tiles, D] buffer, summed in fixed order.
Statistics are float32 (float64 for the tile prefix) whatever x's dtype. No atomics: runs are bitwise
reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["TimestepNormFunction", "timestep_norm"]

NormState = tuple[Tensor, Tensor, Tensor]  # count [B] int64, mean [B, G], var [B, G]


@triton.jit
def _load_tile(x_ptr, pad_ptr, b, c, g, L, D, DG, BT: tl.constexpr, BF: tl.constexpr, HAS_PAD: tl.constexpr):
    """The [BT, BF] tile of group g (float32, zero outside), its valid steps and element mask."""
    offs_t = c * BT + tl.arange(0, BT)
    offs_f = tl.arange(0, BF)
    in_t = offs_t < L
    rows = b.to(tl.int64) * L + offs_t
    elem = in_t[:, None] & (offs_f[None, :] < DG)
    offs = rows[:, None] * D + g * DG + offs_f[None, :]
    x = tl.load(x_ptr + offs, mask=elem, other=0.0).to(tl.float32)
    valid = in_t
    if HAS_PAD:
        valid = valid & (tl.load(pad_ptr + rows, mask=in_t, other=1) == 0)
    return x, valid, elem, offs


@triton.jit
def _first_valid_mean(x, valid, DG, BT: tl.constexpr):
    """Mean of the first valid step of the tile (0 if none): the shift that makes x - r exact."""
    idx = tl.arange(0, BT)
    first = tl.min(tl.where(valid, idx, BT), axis=0)
    return tl.sum(tl.where(idx == first, tl.sum(x, axis=1), 0.0), axis=0) / DG


@triton.jit
def _step_stats(x, r, elem, DG):
    """Per step: x - r, the mean offset delta = mean(x) - r and the population variance (two-pass)."""
    xs = tl.where(elem, x - r, 0.0)
    delta = tl.sum(xs, axis=1) / DG
    dev = tl.where(elem, xs - delta[:, None], 0.0)
    return xs, delta, tl.sum(dev * dev, axis=1) / DG


@triton.jit
def _running_stats(x, valid, elem, st_ptr, b, c, g, G, NC, DG, BT: tl.constexpr):
    """Per step of the tile: x - r, the running mean offset E (M_t = r + E_t), variance V_t, count n_t,
    from the tile's start state (n, hi, lo, V) with M = hi + lo."""
    sp = st_ptr + ((b.to(tl.int64) * NC + c) * G + g) * 4
    n0 = tl.load(sp)
    hi = tl.load(sp + 1)
    lo = tl.load(sp + 2)
    v0 = tl.load(sp + 3)
    has_prior = n0 > 0
    r = tl.where(has_prior, hi, _first_valid_mean(x, valid, DG, BT))
    m0 = tl.where(has_prior, lo, 0.0)  # prior mean relative to r
    xs, delta, var = _step_stats(x, r, elem, DG)
    w = valid.to(tl.float32)
    k = tl.cumsum(w, axis=0)
    c1 = tl.cumsum(w * delta, axis=0)
    c2 = tl.cumsum(w * (var + delta * delta), axis=0)
    n = n0 + k
    inv_n = 1.0 / tl.maximum(n, 1.0)
    e = (n0 * m0 + c1) * inv_n
    # n V = n0 V0 + n0 m0² + Σ (var_s + δ_s²) - n E²   (sum of squares about M_t, all relative to r)
    v = tl.maximum((n0 * (v0 + m0 * m0) + c2) * inv_n - e * e, 0.0)
    return xs, r, e, v, n, inv_n


@triton.jit
def _chunk_stats(
    x_ptr, pad_ptr, out_ptr, L, D, G, NC, DG,
    HAS_PAD: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr,
):  # fmt: skip
    """out[b, c, g] = (valid count k, shift r, mean offset e, variance v) of the tile's valid elements."""
    c, g, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x, valid, elem, _ = _load_tile(x_ptr, pad_ptr, b, c, g, L, D, DG, BT, BF, HAS_PAD)
    r = _first_valid_mean(x, valid, DG, BT)
    _, delta, var = _step_stats(x, r, elem, DG)
    w = valid.to(tl.float32)
    k = tl.sum(w, axis=0)
    e = tl.sum(w * delta, axis=0) / tl.maximum(k, 1.0)
    dd = delta - e
    v = tl.sum(w * (var + dd * dd), axis=0) / tl.maximum(k, 1.0)
    op = out_ptr + ((b.to(tl.int64) * NC + c) * G + g) * 4
    tl.store(op, k)
    tl.store(op + 1, r)
    tl.store(op + 2, e)
    tl.store(op + 3, v)


@triton.jit
def _fwd_output(
    x_ptr, pad_ptr, w_ptr, b_ptr, st_ptr, y_ptr, L, D, G, NC, DG, eps,
    HAS_PAD: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr,
):  # fmt: skip
    c, g, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x, valid, elem, offs = _load_tile(x_ptr, pad_ptr, b, c, g, L, D, DG, BT, BF, HAS_PAD)
    xs, r, e, v, n, inv_n = _running_stats(x, valid, elem, st_ptr, b, c, g, G, NC, DG, BT)
    rstd = 1.0 / tl.sqrt(v + eps)
    offs_f = tl.arange(0, BF)
    mf = offs_f < DG
    scale = 1.0 + tl.load(w_ptr + g * DG + offs_f, mask=mf, other=0.0).to(tl.float32)
    shift = tl.load(b_ptr + g * DG + offs_f, mask=mf, other=0.0).to(tl.float32)
    y = (xs - e[:, None]) * rstd[:, None] * scale[None, :] + shift[None, :]
    y = tl.where(valid[:, None], y, 0.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=elem)


@triton.jit
def _bwd_terms(x, valid, elem, gy_ptr, offs, w_ptr, st_ptr, cs_ptr, b, c, g, G, NC, DG, eps,
               BT: tl.constexpr, BF: tl.constexpr):  # fmt: skip
    """Per step: the summands a_t = (gM - 2 gV (M - c)) / n, b_t = gV / n and what dx needs."""
    xs, r, e, v, n, inv_n = _running_stats(x, valid, elem, st_ptr, b, c, g, G, NC, DG, BT)
    rstd = 1.0 / tl.sqrt(v + eps)
    offs_f = tl.arange(0, BF)
    mf = offs_f < DG
    scale = 1.0 + tl.load(w_ptr + g * DG + offs_f, mask=mf, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + offs, mask=elem, other=0.0).to(tl.float32)
    gy = tl.where(valid[:, None], gy, 0.0)
    yhat = tl.where(elem, (xs - e[:, None]) * rstd[:, None], 0.0)
    gyhat = gy * scale[None, :]
    g_mean = -rstd * tl.sum(gyhat, axis=1)
    g_var = -0.5 * rstd * rstd * tl.sum(gyhat * yhat, axis=1)
    r_c = r - tl.load(cs_ptr + b * G + g)  # r - c
    a = tl.where(valid, (g_mean - 2.0 * g_var * (r_c + e)) * inv_n, 0.0)
    bb = tl.where(valid, g_var * inv_n, 0.0)
    return a, bb, xs, r_c, rstd, gy, gyhat, yhat


@triton.jit
def _bwd_chunk(
    x_ptr, pad_ptr, gy_ptr, w_ptr, st_ptr, cs_ptr, out_ptr, L, D, G, NC, DG, eps,
    HAS_PAD: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr,
):  # fmt: skip
    c, g, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x, valid, elem, offs = _load_tile(x_ptr, pad_ptr, b, c, g, L, D, DG, BT, BF, HAS_PAD)
    a, bb, _, _, _, _, _, _ = _bwd_terms(
        x, valid, elem, gy_ptr, offs, w_ptr, st_ptr, cs_ptr, b, c, g, G, NC, DG, eps, BT, BF
    )
    op = out_ptr + ((b.to(tl.int64) * NC + c) * G + g) * 2
    tl.store(op, tl.sum(a, axis=0))
    tl.store(op + 1, tl.sum(bb, axis=0))


@triton.jit
def _bwd_dx(
    x_ptr, pad_ptr, gy_ptr, w_ptr, st_ptr, cs_ptr, car_ptr, dx_ptr, dw_ptr, db_ptr, L, D, G, NC, DG, eps,
    HAS_PAD: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr,
):  # fmt: skip
    c, g, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x, valid, elem, offs = _load_tile(x_ptr, pad_ptr, b, c, g, L, D, DG, BT, BF, HAS_PAD)
    a, bb, xs, r_c, rstd, gy, gyhat, yhat = _bwd_terms(
        x, valid, elem, gy_ptr, offs, w_ptr, st_ptr, cs_ptr, b, c, g, G, NC, DG, eps, BT, BF
    )
    cp = car_ptr + ((b.to(tl.int64) * NC + c) * G + g) * 2
    big_a = tl.cumsum(a, axis=0, reverse=True) + tl.load(cp)
    big_b = tl.cumsum(bb, axis=0, reverse=True) + tl.load(cp + 1)
    dx = rstd[:, None] * gyhat + (big_a[:, None] + 2.0 * big_b[:, None] * (xs + r_c)) / DG
    dx = tl.where(valid[:, None], dx, 0.0)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=elem)
    offs_f = tl.arange(0, BF)
    mf = offs_f < DG
    pp = (b.to(tl.int64) * NC + c) * D + g * DG + offs_f
    tl.store(dw_ptr + pp, tl.sum(gy * yhat, axis=0), mask=mf)
    tl.store(db_ptr + pp, tl.sum(gy, axis=0), mask=mf)


# --------------------------------------------------------------------------------------------- launchers


def _config(length: int, group_width: int, block_t: int | None):
    bf = triton.next_power_of_2(group_width)
    if block_t is None:
        block_t = max(1, min(64, 4096 // bf))
    block_t = min(triton.next_power_of_2(block_t), triton.next_power_of_2(max(length, 1)))
    warps = 4 if block_t * bf >= 2048 else (2 if block_t * bf >= 512 else 1)
    return block_t, bf, warps


def _exclusive_cumsum(t: Tensor, dim: int) -> Tensor:
    return torch.cumsum(t, dim) - t


def _mean_var(n: Tensor, s1: Tensor, s2: Tensor, shift: Tensor, mean0: Tensor, var0: Tensor):
    """Mean and variance from shifted sums; the prior (mean0, var0) where nothing was seen (n = 0)."""
    safe = n.clamp(min=1)
    mean = shift + s1 / safe
    var = (s2 / safe - (s1 / safe).square()).clamp(min=0)
    keep = n == 0
    return torch.where(keep, mean0, mean), torch.where(keep, var0, var)


def _prefix(stats: Tensor, count0: Tensor, mean0: Tensor, var0: Tensor):
    """Tile summaries [B, NC, G, 4] (k, r, e, v) + incoming state -> start states [B, NC, G, 4]
    (n, mean hi, mean lo, var) as float32, the final (mean, var, count) and the shift c [B, G].

    Float64 sums after a shift, as the reference does per step; here over tiles, so they are tiny."""
    f64 = torch.float64
    k, r, e, v = stats.to(f64).unbind(-1)
    m = r + e  # tile mean
    n0 = count0.to(f64).view(-1, 1)  # [B, 1]
    mean0, var0 = mean0.to(f64), var0.to(f64)
    total = k.sum(1)  # [B, G]
    seg_mean = (k * m).sum(1) / total.clamp(min=1)
    shift = torch.where(n0 > 0, mean0, seg_mean)  # [B, G]
    dm = m - shift[:, None]
    d0 = mean0 - shift
    s1_0, s2_0 = n0 * d0, n0 * (var0 + d0.square())
    a1, a2 = k * dm, k * (v + dm.square())  # Chan: a tile adds k (v + (m - shift)²) to S2

    n_start = n0.unsqueeze(1) + _exclusive_cumsum(k, 1)  # [B, NC, G]
    s1 = s1_0.unsqueeze(1) + _exclusive_cumsum(a1, 1)
    s2 = s2_0.unsqueeze(1) + _exclusive_cumsum(a2, 1)
    mean_s, var_s = _mean_var(n_start, s1, s2, shift[:, None], mean0[:, None], var0[:, None])
    hi = mean_s.to(torch.float32)
    lo = (mean_s - hi.to(f64)).to(torch.float32)
    starts = torch.stack([n_start.to(torch.float32), hi, lo, var_s.to(torch.float32)], -1).contiguous()
    n_final = n0 + total
    mean_f, var_f = _mean_var(n_final, s1_0 + a1.sum(1), s2_0 + a2.sum(1), shift, mean0, var0)
    return starts, mean_f, var_f, n_final, shift


def _forward(x: Tensor, weight: Tensor, bias: Tensor, count0, mean0, var0, pad, groups: int, eps: float, cfg):
    """Launches tile statistics -> (PyTorch) prefix over tiles -> outputs. Returns y, the final mean and
    variance (float64), and the tile start states, final counts and shift the backward needs."""
    b, length, d = x.shape
    bt, bf, warps = cfg
    dg, nc = d // groups, triton.cdiv(length, bt)
    grid = (nc, groups, b)
    pad_arg = pad if pad is not None else x
    stats = torch.empty(b, nc, groups, 4, device=x.device, dtype=torch.float32)
    _chunk_stats[grid](
        x, pad_arg, stats, length, d, groups, nc, dg,
        HAS_PAD=pad is not None, BT=bt, BF=bf, num_warps=warps,
    )  # fmt: skip
    starts, mean_f, var_f, n_final, shift = _prefix(stats, count0, mean0, var0)
    y = torch.empty_like(x)
    _fwd_output[grid](
        x, pad_arg, weight, bias, starts, y, length, d, groups, nc, dg, eps,
        HAS_PAD=pad is not None, BT=bt, BF=bf, num_warps=warps,
    )  # fmt: skip
    return y, mean_f, var_f, (starts, n_final, shift)


def _backward(x, pad, weight, gy, g_mean, g_var, count0, mean0, mean_f, saved, groups: int, eps: float, cfg):
    """Launches tile sums -> (PyTorch) reverse prefix over tiles -> dx and dweight / dbias partials.
    Returns dx, dweight, dbias (float32) and the incoming state's gradients (float64)."""
    starts, n_final, shift = saved
    b, length, d = x.shape
    bt, bf, warps = cfg
    dg, nc = d // groups, triton.cdiv(length, bt)
    grid = (nc, groups, b)
    pad_arg = pad if pad is not None else x
    f64 = torch.float64
    cs = shift.to(torch.float32).contiguous()  # the constant c of the module docstring
    sums = torch.empty(b, nc, groups, 2, device=x.device, dtype=torch.float32)
    _bwd_chunk[grid](
        x, pad_arg, gy, weight, starts, cs, sums, length, d, groups, nc, dg, eps,
        HAS_PAD=pad is not None, BT=bt, BF=bf, num_warps=warps,
    )  # fmt: skip
    # The returned state's cotangents: one more "step" after the last, with n = the final count.
    zero = torch.zeros(b, groups, device=x.device, dtype=f64)
    gm = zero if g_mean is None else g_mean.to(f64)
    gv = zero if g_var is None else g_var.to(f64)
    inv_nf = torch.where(n_final > 0, 1.0 / n_final.clamp(min=1), 0.0)
    end = torch.stack([(gm - 2 * gv * (mean_f - cs.to(f64))) * inv_nf, gv * inv_nf], -1)  # [B, G, 2]
    s64 = sums.to(f64)
    rev = torch.flip(torch.cumsum(torch.flip(s64, [1]), 1), [1])  # Σ over tiles >= c
    carry = (rev - s64 + end.unsqueeze(1)).to(torch.float32).contiguous()  # Σ over tiles > c, + end
    total = rev[:, 0] + end  # (A_0, B_0)
    dx = torch.empty_like(x)
    dw_part = torch.empty(b * nc, d, device=x.device, dtype=torch.float32)
    db_part = torch.empty(b * nc, d, device=x.device, dtype=torch.float32)
    _bwd_dx[grid](
        x, pad_arg, gy, weight, starts, cs, carry, dx, dw_part, db_part, length, d, groups, nc, dg, eps,
        HAS_PAD=pad is not None, BT=bt, BF=bf, num_warps=warps,
    )  # fmt: skip
    n0 = count0.to(f64).view(-1, 1)
    g_mean0 = n0 * (total[..., 0] + 2 * (mean0.to(f64) - cs.to(f64)) * total[..., 1])
    g_var0 = n0 * total[..., 1]
    empty = n_final == 0  # nothing seen at all: the state passes through unchanged
    g_mean0 = torch.where(empty, gm, g_mean0)
    g_var0 = torch.where(empty, gv, g_var0)
    # fixed-order reduction of the per-program partials: deterministic
    return dx, dw_part.sum(0), db_part.sum(0), g_mean0, g_var0


# ----------------------------------------------------------------------------------------------------------
# Custom ops (torch.compile sees two opaque calls with known output shapes, no graph break) and autograd
# ----------------------------------------------------------------------------------------------------------


def _tsn_forward(x, weight, bias, mean0, var0, count0, pad, num_groups, eps, block_t):
    """(y, final mean and variance float32, then for the backward: the final mean float64, the tile start
    states [B, NC, G, 4], the final counts and the shift [B, G] float64)."""
    x = x.contiguous()
    cfg = _config(x.shape[1], x.shape[2] // num_groups, block_t)
    y, mean_f, var_f, (starts, n_final, shift) = _forward(
        x, weight.contiguous(), bias.contiguous(), count0, mean0, var0, pad, num_groups, eps, cfg
    )
    return y, mean_f.to(torch.float32), var_f.to(torch.float32), mean_f, starts, n_final, shift


def _tsn_backward(gy, g_mean, g_var, x, pad, weight, count0, mean0, mean_f, starts, n_final, shift, num_groups,
                  eps, block_t):  # fmt: skip
    """(dx, dweight, dbias float32, the incoming mean's and variance's gradients float64)."""
    x = x.contiguous()
    cfg = _config(x.shape[1], x.shape[2] // num_groups, block_t)
    return _backward(
        x, pad, weight.contiguous(), gy.contiguous(), g_mean, g_var, count0, mean0, mean_f,
        (starts, n_final, shift), num_groups, eps, cfg,
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
    b, length, d = x.shape
    nc = triton.cdiv(length, _config(length, d // num_groups, block_t)[0])
    stat = lambda dtype: x.new_empty(b, num_groups, dtype=dtype)
    starts = x.new_empty(b, nc, num_groups, 4, dtype=torch.float32)
    f32, f64 = torch.float32, torch.float64
    return x.new_empty(x.shape), stat(f32), stat(f32), stat(f64), starts, stat(f64), stat(f64)


@torch.library.custom_op(
    "mega_suite::timestep_norm_bwd",
    mutates_args=(),
    schema="(Tensor gy, Tensor? g_mean, Tensor? g_var, Tensor x, Tensor? pad, Tensor weight, Tensor count0, "
    "Tensor mean0, Tensor mean_f, Tensor starts, Tensor n_final, Tensor shift, int num_groups, float eps, "
    "int? block_t) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _tsn_bwd_op(gy, g_mean, g_var, x, pad, weight, count0, mean0, mean_f, starts, n_final, shift, num_groups, eps,
                block_t):  # fmt: skip
    return _tsn_backward(
        gy,
        g_mean,
        g_var,
        x,
        pad,
        weight,
        count0,
        mean0,
        mean_f,
        starts,
        n_final,
        shift,
        num_groups,
        eps,
        block_t,
    )


@_tsn_bwd_op.register_fake
def _(
    gy, g_mean, g_var, x, pad, weight, count0, mean0, mean_f, starts, n_final, shift, num_groups, eps, block_t
):
    d = x.shape[2]
    per_channel = lambda: x.new_empty(d, dtype=torch.float32)
    stat = lambda: x.new_empty(mean_f.shape, dtype=torch.float64)
    return x.new_empty(x.shape), per_channel(), per_channel(), stat(), stat()


class TimestepNormFunction(torch.autograd.Function):
    """The kernels run inside two custom ops (``mega_suite::timestep_norm_fwd`` / ``_bwd``), so
    torch.compile keeps a block that uses them in one graph."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean0, var0, count0, pad, num_groups, eps, block_t):
        y, mean, var, mean_f, starts, n_final, shift = torch.ops.mega_suite.timestep_norm_fwd(
            x, weight, bias, mean0, var0, count0, pad, num_groups, eps, block_t
        )
        ctx.save_for_backward(x, pad, weight, count0, mean0, mean_f, starts, n_final, shift)
        ctx.groups, ctx.eps, ctx.block_t = num_groups, eps, block_t
        ctx.dtypes = (weight.dtype, bias.dtype, mean0.dtype, var0.dtype)
        ctx.set_materialize_grads(False)
        return y, mean, var

    @staticmethod
    def backward(ctx, gy, g_mean, g_var):
        x, pad, weight, count0, mean0, mean_f, starts, n_final, shift = ctx.saved_tensors
        if gy is None:
            gy = torch.zeros_like(x)
        dx, dw, db, g_mean0, g_var0 = torch.ops.mega_suite.timestep_norm_bwd(
            gy, g_mean, g_var, x, pad, weight, count0, mean0, mean_f, starts, n_final, shift, ctx.groups,
            ctx.eps, ctx.block_t,
        )  # fmt: skip
        grads = (g.to(dtype) for g, dtype in zip((dw, db, g_mean0, g_var0), ctx.dtypes))
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
    if state is None:
        count0 = torch.zeros(b, dtype=torch.int64, device=x.device)
        mean0 = torch.zeros(b, num_groups, dtype=torch.float32, device=x.device)
        var0 = torch.ones(b, num_groups, dtype=torch.float32, device=x.device)
    else:
        count0, mean0, var0 = state
        mean0, var0 = mean0.to(torch.float32), var0.to(torch.float32)
    if length == 0:
        return x.clone(), (count0, mean0, var0)
    pad = None if padding_mask is None else padding_mask.to(torch.int8).contiguous()
    y, mean, var = TimestepNormFunction.apply(
        x, weight, bias, mean0, var0, count0, pad, num_groups, eps, block_t
    )
    count = count0 + (length if padding_mask is None else (~padding_mask).sum(1))
    return y, (count, mean, var)
