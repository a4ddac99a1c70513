"""CEMA: the complex exponential moving average of Megalodon (docs/architecture.md#cema).

``cema`` runs the fused Triton scan (``kernels.cema.triton``) for CUDA tensors with ``method="auto"``
(see ``kernels.dispatch``), and the PyTorch reference (``kernels.cema.reference``) otherwise: on CPU, in
float64, or when a specific reference method is asked for.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.cema import reference
from kernels.cema.reference import cema_coefficients, cema_kernel, cema_step
from kernels.cema.step import cema_token_step, cema_token_step_real
from kernels.dispatch import use_triton

__all__ = [
    "cema", "cema_coefficients", "cema_kernel", "cema_step", "cema_token_step", "cema_token_step_real",
]  # fmt: skip


def cema(
    x: Tensor,
    p: Tensor,
    q: Tensor,
    gamma: Tensor,
    omega: Tensor,
    h0: Tensor | None = None,
    bidirectional: bool = False,
    padding_mask: Tensor | None = None,
    method: str = "auto",
    return_state: bool = False,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Complex EMA over the time axis; arguments and shapes as ``kernels.cema.reference.cema``.

    x [B, L, D]; p, q, gamma [D, N] ([2D, N] bidirectional); omega [D]; h0 [B, D, N] complex or None;
    padding_mask [B, L] bool (True = padding). Returns y [B, L, D] and h_last [B, D, N] complex or None.
    """
    if (
        method == "auto"
        and x.dim() == 3
        and x.shape[1] > 0
        and torch.float64 not in (x.dtype, p.dtype)
        and use_triton(x, p, q, gamma, omega, h0, padding_mask)
    ):
        from kernels.cema.triton import cema as triton_cema

        return triton_cema(x, p, q, gamma, omega, h0, bidirectional, padding_mask, return_state)
    return reference.cema(
        x, p, q, gamma, omega, h0, bidirectional, padding_mask, method, return_state, chunk_size
    )
