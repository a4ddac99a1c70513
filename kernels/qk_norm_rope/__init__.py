"""Q and K from the shared projection Z: per-head RMS normalisation, the learned scale and offset, and RoPE
restarting in every chunk (docs/architecture.md#normalised-attention).

``qk_norm_rope`` runs one fused Triton kernel forward and one backward for CUDA tensors (see
``kernels.dispatch``; ``kernels.qk_norm_rope.triton.VARIANT`` picks between two kernels) and the PyTorch
reference otherwise (CPU, float64), which stores only Z for backward and recomputes the rest there
(``kernels.recompute``).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kernels.dispatch import use_triton
from kernels.qk_norm_rope import reference
from kernels.recompute import recompute

__all__ = ["qk_norm_rope"]


@functools.cache
def _inv_freq(zd: int, base: float, device: torch.device) -> Tensor:
    """base^(-2j/zd) in float32, as the reference computes it; one tensor per (width, base, device)."""
    return base ** (-torch.arange(0, zd, 2, device=device, dtype=torch.float32) / zd)


@functools.cache
def _cos_sin_table(zd: int, base: float, chunk: int, device: torch.device) -> Tensor:
    """The rows variant's [C, zd/2, 2] table; one tensor per (width, base, chunk, device)."""
    from kernels.qk_norm_rope import triton as fused

    return fused.cos_sin_table(zd, base, chunk, device)


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
    """Normalised, scaled, offset and rotated Q and K.

    Args:
        z: [B, L, h, zd], the projection M W_z + b_z viewed per head (zd even).
        gamma, beta: [2, h * zd]; row 0 for Q, row 1 for K; the scale is applied as (1 + gamma) / sqrt(zd).
        base: RoPE base; eps: the normalisation's epsilon.
        chunk_size, start: token l is at RoPE position (start + l) mod chunk_size.
        out_dtype: the dtype of Q and K (z's when None): V's under autocast, so attention sees one dtype.

    Returns:
        (Q, K), each [B, L, h, zd].
    """
    if z.dim() != 4 or z.shape[-1] % 2:
        raise ValueError(f"z must be [B, L, h, zd] with zd even, got shape {tuple(z.shape)}")
    h, zd = z.shape[-2:]
    if gamma.shape != (2, h * zd) or beta.shape != (2, h * zd):
        raise ValueError(
            f"gamma and beta must be [2, {h * zd}], got {tuple(gamma.shape)}, {tuple(beta.shape)}"
        )
    out_dtype = out_dtype or z.dtype
    if z.dtype != torch.float64 and z.shape[1] > 0 and use_triton(z, gamma, beta):
        from kernels.qk_norm_rope import triton as fused  # imports Triton only when it runs

        if fused.VARIANT == "rows" and fused.rows_fit(zd, chunk_size):
            table = _cos_sin_table(zd, float(base), int(chunk_size), z.device)
            return fused.qk_norm_rope_rows(z, gamma, beta, table, eps, chunk_size, start, out_dtype)
        inv = _inv_freq(zd, float(base), z.device)
        return fused.qk_norm_rope(z, gamma, beta, inv, eps, chunk_size, start, out_dtype)
    fn = functools.partial(
        reference.qk_norm_rope, base=base, eps=eps, chunk_size=chunk_size, start=start, out_dtype=out_dtype
    )
    return recompute(fn, z, gamma, beta)
