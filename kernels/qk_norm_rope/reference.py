"""Q and K from the shared projection Z, in plain PyTorch (docs/architecture.md#normalised-attention).

Per head, Z is RMS-normalised without an affine map, scaled by (1 + γ) / sqrt(Z/h), offset by β (row 0 of
γ and β for Q, row 1 for K), and rotated by RoPE on interleaved pairs at positions that restart in every
chunk. Statistics and the rotation run in float32 (float64 for a float64 Z); Q and K come out in
``out_dtype``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def chunk_positions(length: int, start: int, chunk_size: int, device: torch.device) -> Tensor:
    """The RoPE position of each of ``length`` tokens starting at stream offset ``start``: (start + l) mod C."""
    return (torch.arange(length, device=device) + start) % chunk_size


def rope_pairs(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """RoPE on interleaved pairs (x[2i], x[2i+1]) of x [..., L, h, d] at ``positions`` [L], in x's dtype."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, device=x.device, dtype=x.dtype) / d)
    angle = positions.to(x.dtype).unsqueeze(-1) * inv  # [L, d/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x0, x1 = x.unflatten(-1, (d // 2, 2)).unbind(-1)
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def qk_norm_rope(
    z: Tensor,
    gamma: Tensor,
    beta: Tensor,
    base: float,
    eps: float,
    chunk_size: int,
    start: int = 0,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """z [B, L, h, zd]; gamma, beta [2, h * zd] -> (RoPE(Q), RoPE(K)) [B, L, h, zd] in ``out_dtype`` (z's
    dtype when None); token l sits at RoPE position (start + l) mod chunk_size."""
    b, length, h, zd = z.shape
    zf = z.double() if z.dtype == torch.float64 else z.float()
    z_hat = zf * torch.rsqrt(zf.square().mean(-1, keepdim=True) + eps)
    scale = (1 + gamma.to(zf.dtype).view(2, 1, 1, h, zd)) / math.sqrt(zd)
    qk = z_hat.unsqueeze(0) * scale + beta.to(zf.dtype).view(2, 1, 1, h, zd)
    positions = chunk_positions(length, start, chunk_size, z.device)
    out = rope_pairs(qk, positions, base).to(out_dtype or z.dtype)
    return out[0], out[1]
