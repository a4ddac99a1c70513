"""One TimestepNorm step for one new token (decoding), beside the sequence forms in ``reference.py``."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.timestep_norm.reference import NormState


def timestep_norm_step(
    x: Tensor, state: NormState, w1: Tensor, b: Tensor, groups: int, eps: float
) -> tuple[Tensor, NormState]:
    """x [B, D] float32 at the step after ``state`` -> (y [B, D], new state); ``w1`` is the folded 1 + weight.

    The Welford update of docs/architecture.md#timestepnorm, statistics in float64: with n = n₀ + 1,
    δ = μ_t − M, M' = M + δ/n and V' = V + (σ²_t − V)/n + (δ/n)(δ − δ/n); y = (x − M') / sqrt(V' + eps)."""
    count0, mean0, var0 = state
    bsz, d = x.shape
    xd = x.view(bsz, groups, d // groups).double()
    var_t, mu_t = torch.var_mean(xd, dim=-1, unbiased=False, keepdim=True)  # [B, G, 1]
    count = count0 + 1
    inv_n = count.double().reciprocal().view(bsz, 1, 1)
    delta = mu_t - mean0.unsqueeze(-1)
    step = delta * inv_n
    mean = mean0.unsqueeze(-1) + step
    var0 = var0.unsqueeze(-1)
    var = torch.addcmul(torch.addcmul(var0, var_t - var0, inv_n), step, delta - step)
    y = ((xd - mean) * torch.rsqrt(var + eps)).view(bsz, d).float()
    return torch.addcmul(b, y, w1), (count, mean.view(bsz, groups).float(), var.view(bsz, groups).float())
