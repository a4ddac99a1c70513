"""TimestepNorm (causal group normalisation, docs/architecture.md#timestepnorm) and its whole-sequence form, in plain PyTorch.

Numerics: the running mean/variance of a group over all valid steps <= t is
    M_t = S1_t / n_t,  V_t = S2_t / n_t - M_t^2,
with S1, S2 cumulative sums of the per-step group mean and mean square. Done naively in float32 this
cancels catastrophically (inputs ~ N(100, 1): S2/n ~ 1e4, V ~ 1). Two things make it exact enough:
1. every group is shifted by a constant s (the mean of its first segment statistics, detached); x - s is
   exact in floating point for x close to s (Sterbenz), and the statistics of x - s are O(std);
2. the cumulative sums run over the small [B, L, G] per-step statistics in float64 (negligible cost next
   to the [B, L, D] elementwise work, which stays in float32).
The result equals Welford with Kahan compensation to float32 rounding, is differentiable by autograd,
and parallel over time.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["timestep_norm", "group_norm", "merge_norm_states"]

NormState = tuple[Tensor, Tensor, Tensor]  # count [B] int64, mean [B, G], var [B, G]


def _stat_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check(x: Tensor, weight: Tensor, num_groups: int, padding_mask: Tensor | None) -> None:
    if x.dim() != 3:
        raise ValueError(f"expected x of shape [B, L, D], got {tuple(x.shape)}")
    d = x.shape[-1]
    if d % num_groups != 0:
        raise ValueError(f"model width D={d} is not divisible by num_groups={num_groups}")
    if weight.shape != (d,):
        raise ValueError(f"norm weight must be [{d}], got {tuple(weight.shape)}")
    if padding_mask is not None and padding_mask.shape != x.shape[:2]:
        raise ValueError(
            f"padding_mask must be [B, L] = {tuple(x.shape[:2])}, got {tuple(padding_mask.shape)}"
        )


def timestep_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    num_groups: int,
    eps: float = 1e-5,
    state: NormState | None = None,
    padding_mask: Tensor | None = None,
) -> tuple[Tensor, NormState]:
    """Causal group norm: statistics of each group over all valid steps up to and including t.

    Args:
        x: [B, L, D].
        weight, bias: [D], applied as (1 + weight), bias.
        state: carried (count [B] int64, mean [B, G], var [B, G]) or None (count 0).
        padding_mask: [B, L] bool, True = padding; padded steps output 0 and leave the state unchanged.

    Returns:
        y [B, L, D] in x's dtype, and the state after the last step.
    """
    _check(x, weight, num_groups, padding_mask)
    b, length, d = x.shape
    if length == 1 and padding_mask is None and state is not None:
        return _single_step(x, weight, bias, num_groups, eps, state)
    g = num_groups
    sdt = _stat_dtype(x)
    acc = torch.float64  # dtype of the running sums over time
    xg = x.to(sdt).reshape(b, length, g, d // g)
    valid = (
        torch.ones(b, length, dtype=torch.bool, device=x.device) if padding_mask is None else ~padding_mask
    )
    validf = valid.to(acc).unsqueeze(-1)  # [B, L, 1]

    if state is None:
        count0 = torch.zeros(b, dtype=torch.int64, device=x.device)
        mean0 = torch.zeros(b, g, dtype=sdt, device=x.device)
        var0 = torch.ones(b, g, dtype=sdt, device=x.device)
    else:
        count0, mean0, var0 = state
    with torch.no_grad():
        # The shift: the prior mean if there is a prior, else the mean of this segment's valid steps.
        step_mean = xg.mean(-1)
        seg_n = validf.sum(1).clamp(min=1)
        seg_mean = (step_mean.to(acc) * validf).sum(1) / seg_n
        shift = torch.where((count0 > 0).unsqueeze(-1), mean0.to(acc), seg_mean).to(sdt)  # [B, G]
    xs = xg - shift[:, None, :, None]
    mu = xs.mean(-1).to(acc) * validf  # [B, L, G] per-step mean of shifted x
    m2 = xs.square().mean(-1).to(acc) * validf  # per-step mean square of shifted x

    n0 = count0.to(acc).unsqueeze(-1)  # [B, 1]
    d0 = mean0.to(acc) - shift.to(acc)
    s1 = torch.cumsum(mu, 1) + (n0 * d0).unsqueeze(1)
    s2 = torch.cumsum(m2, 1) + (n0 * (var0.to(acc) + d0.square())).unsqueeze(1)
    n = torch.cumsum(validf, 1) + n0.unsqueeze(1)  # [B, L, 1] (broadcast over G)
    n_safe = n.clamp(min=1)
    mean_s = s1 / n_safe
    var = (s2 / n_safe - mean_s.square()).clamp(min=0)

    rstd = torch.rsqrt(var + eps).to(sdt)
    y = (xs - mean_s.to(sdt).unsqueeze(-1)) * rstd.unsqueeze(-1)
    y = y.reshape(b, length, d) * (1 + weight.to(sdt)) + bias.to(sdt)
    if padding_mask is not None:
        y = y.masked_fill(padding_mask.unsqueeze(-1), 0.0)

    if length > 0:
        count = count0 + valid.sum(1)
        last_mean = (mean_s[:, -1] + shift.to(acc)).to(sdt)
        last_var = var[:, -1].to(sdt)
        # Rows with no valid step at all keep their prior state.
        keep = (count == count0).unsqueeze(-1)
        mean = torch.where(keep, mean0.to(sdt), last_mean)
        var_out = torch.where(keep, var0.to(sdt), last_var)
    else:
        count, mean, var_out = count0, mean0.to(sdt), var0.to(sdt)
    return y.to(x.dtype), (count, mean, var_out)


def _single_step(
    x: Tensor, weight: Tensor, bias: Tensor, g: int, eps: float, state: NormState
) -> tuple[Tensor, NormState]:
    """One new step (decoding): the Welford update of docs/architecture.md#timestepnorm directly, in float64 for the statistics."""
    b, _, d = x.shape
    count0, mean0, var0 = state
    sdt = _stat_dtype(x)
    xg = x.to(sdt).reshape(b, g, d // g)
    var_t, mu_t = torch.var_mean(xg.double(), dim=-1, unbiased=False)  # [B, G]
    n0 = count0.double().unsqueeze(-1)
    n = n0 + 1
    delta = mu_t - mean0.double()
    mean = mean0.double() + delta / n
    var = (n0 / n) * var0.double() + var_t / n + (n0 / n.square()) * delta.square()
    rstd = torch.rsqrt(var + eps).to(sdt)
    y = (xg - mean.to(sdt).unsqueeze(-1)) * rstd.unsqueeze(-1)
    y = y.reshape(b, 1, d) * (1 + weight.to(sdt)) + bias.to(sdt)
    return y.to(x.dtype), (count0 + 1, mean.to(mean0.dtype), var.to(var0.dtype))


def merge_norm_states(a: NormState, b: NormState) -> NormState:
    """Chan/Welford merge of two disjoint groups of steps: the state of their union."""
    na, ma, va = a
    nb, mb, vb = b
    n = na + nb
    fa = (na.to(ma.dtype) / n.clamp(min=1).to(ma.dtype)).unsqueeze(-1)
    fb = 1 - fa
    delta = mb - ma
    mean = ma + fb * delta
    var = fa * va + fb * vb + fa * fb * delta.square()
    empty = (n == 0).unsqueeze(-1)
    return n, torch.where(empty, ma, mean), torch.where(empty, va, var)


def group_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    num_groups: int,
    eps: float = 1e-5,
    padding_mask: Tensor | None = None,
) -> Tensor:
    """Whole-sequence group norm for classification: statistics over all valid steps at once.

    x: [B, L, D]; weight, bias: [D] as (1 + weight), bias; padding_mask: [B, L] True = padding
    (excluded from the statistics, output 0). Returns [B, L, D].
    """
    _check(x, weight, num_groups, padding_mask)
    b, length, d = x.shape
    sdt = _stat_dtype(x)
    xg = x.to(sdt).reshape(b, length, num_groups, d // num_groups)
    if padding_mask is None:
        var, mean = torch.var_mean(xg, dim=(1, 3), unbiased=False, keepdim=True)
    else:
        w = (~padding_mask).to(sdt)[:, :, None, None]
        count = w.sum(1, keepdim=True).clamp(min=1) * (d // num_groups)
        mean = (xg * w).sum((1, 3), keepdim=True) / count
        var = ((xg - mean).square() * w).sum((1, 3), keepdim=True) / count
    y = (xg - mean) * torch.rsqrt(var + eps)
    y = y.reshape(b, length, d) * (1 + weight.to(sdt)) + bias.to(sdt)
    if padding_mask is not None:
        y = y.masked_fill(padding_mask.unsqueeze(-1), 0.0)
    return y.to(x.dtype)
