"""CEMA: the complex exponential moving average of Megalodon (docs/architecture.md#cema).

``cema`` runs the fused Triton scan (``kernels.cema.triton``) for CUDA tensors with ``method="auto"``
(see ``kernels.dispatch``), and the PyTorch reference (``kernels.cema.reference``) otherwise: on CPU, in
float64, or when a specific reference method is asked for.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.cema import reference
from kernels.cema.reference import cema_kernel, cema_step
from kernels.cema.step import cema_token_step, cema_token_step_real
from kernels.dispatch import use_triton

__all__ = [
    "cema", "cema_coefficients", "cema_from_parameters", "cema_kernel", "cema_step", "cema_token_step",
    "cema_token_step_real",
]  # fmt: skip


def _triton_parameters(*params: Tensor) -> bool:
    return torch.float64 not in tuple(t.dtype for t in params) and use_triton(*params)


def cema_coefficients(
    alpha: Tensor, delta: Tensor, theta: Tensor, gamma: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Raw parameters -> (p [D, N] real, q [D, N] complex, gamma [D, N] complex); arguments as
    ``kernels.cema.reference.cema_coefficients``. For CUDA tensors one Triton kernel each way, q and gamma
    being complex views of its real outputs (no complex arithmetic); otherwise the PyTorch reference."""
    if _triton_parameters(alpha, delta, theta, gamma):
        from kernels.cema.triton import cema_coefficients as triton_coefficients

        return triton_coefficients(alpha, delta, theta, gamma)
    return reference.cema_coefficients(alpha, delta, theta, gamma)


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


def cema_from_parameters(
    x: Tensor,
    alpha: Tensor,
    delta: Tensor,
    theta: Tensor,
    gamma: Tensor,
    omega: Tensor,
    bidirectional: bool = False,
    padding_mask: Tensor | None = None,
    method: str = "auto",
) -> Tensor:
    """CEMA from the raw parameters (no carried state): ``cema(x, *cema_coefficients(...), omega, ...)``.
    For CUDA tensors (``method="auto"``) the coefficient kernel feeds the scan directly, without any complex
    tensor; otherwise the PyTorch reference. Returns y [B, L, D]."""
    params = (alpha, delta, theta, gamma, omega)
    if (
        method == "auto"
        and x.dim() == 3
        and x.dtype != torch.float64
        and _triton_parameters(*params)
        and use_triton(x, padding_mask)
    ):
        from kernels.cema.triton import cema_from_parameters as triton_cema

        return triton_cema(x, alpha, delta, theta, gamma, omega, bidirectional, padding_mask)
    p, q, g = reference.cema_coefficients(alpha, delta, theta, gamma)
    return reference.cema(x, p, q, g, omega, None, bidirectional, padding_mask, method)[0]
