"""CEMA: the complex exponential moving average of Megalodon (docs/architecture.md#cema).

``cema`` runs a Triton kernel for CUDA tensors with ``method="auto"`` (see ``kernels.dispatch``), and the
PyTorch reference (``kernels.cema.reference``) otherwise: on CPU, in float64, or when a specific reference
method is asked for. Two Triton forms exist (docs/kernels.md#cema): the recurrence scan
(``kernels.cema.triton``, the default) and the chunked form as GEMMs on the tensor cores
(``kernels.cema.tensor_cores``), chosen by ``method="tensor_cores"`` on a call, ``force_engine("tensor_cores")``
or ``MEGA_SUITE_CEMA=tc`` in the environment.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from kernels.cema import reference
from kernels.cema.reference import cema_kernel, cema_step
from kernels.cema.step import cema_token_step, cema_token_step_real
from kernels.dispatch import use_triton

__all__ = [
    "ENGINES", "cema", "cema_coefficients", "cema_engine", "cema_from_parameters", "cema_kernel", "cema_step",
    "cema_token_step", "cema_token_step_real", "force_engine",
]  # fmt: skip

ENGINES = ("scan", "tensor_cores")  # the CUDA implementations of method="auto"
_ENV_NAMES = {
    "": "scan",
    "auto": "scan",
    "scan": "scan",
    "tc": "tensor_cores",
    "tensor_cores": "tensor_cores",
}
_FORCED_ENGINE: str | None = None


def force_engine(engine: str | None) -> None:
    """Run every ``method="auto"`` CUDA call on ``engine`` (one of ``ENGINES``); None: back to the environment."""
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"CEMA engine must be one of {ENGINES} or None, got {engine!r}")
    global _FORCED_ENGINE
    _FORCED_ENGINE = engine


def cema_engine() -> str:
    """The CUDA implementation of ``method="auto"``: ``force_engine``'s, else ``MEGA_SUITE_CEMA``
    (scan | tc | tensor_cores | auto), else the scan."""
    if _FORCED_ENGINE is not None:
        return _FORCED_ENGINE
    value = os.environ.get("MEGA_SUITE_CEMA", "").strip().lower()
    if value not in _ENV_NAMES:
        raise ValueError(
            f"MEGA_SUITE_CEMA must be one of {sorted(n for n in _ENV_NAMES if n)}, got {value!r}"
        )
    # the scan stays the default until a GPU measurement (bench/) shows the tensor-core form faster
    return _ENV_NAMES[value]


def _engine(method: str) -> str:
    return "tensor_cores" if method in ("tensor_cores", "tc") else cema_engine()


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
    ``method="tensor_cores"`` (or ``"tc"``) asks for the GEMM form: the Triton kernels on CUDA, the
    reference's ``chunked`` method (the same math) elsewhere.
    """
    tensor_cores = method in ("tensor_cores", "tc")
    if (
        (method == "auto" or tensor_cores)
        and x.dim() == 3
        and x.shape[1] > 0
        and torch.float64 not in (x.dtype, p.dtype)
        and use_triton(x, p, q, gamma, omega, h0, padding_mask)
    ):
        if _engine(method) == "tensor_cores":
            from kernels.cema.tensor_cores import cema as triton_cema
        else:
            from kernels.cema.triton import cema as triton_cema
        return triton_cema(x, p, q, gamma, omega, h0, bidirectional, padding_mask, return_state)
    return reference.cema(
        x, p, q, gamma, omega, h0, bidirectional, padding_mask, "chunked" if tensor_cores else method,
        return_state, chunk_size,
    )  # fmt: skip


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
    tensor; otherwise the PyTorch reference. ``method`` as for ``cema``. Returns y [B, L, D]."""
    params = (alpha, delta, theta, gamma, omega)
    tensor_cores = method in ("tensor_cores", "tc")
    if (
        (method == "auto" or tensor_cores)
        and x.dim() == 3
        and x.dtype != torch.float64
        and _triton_parameters(*params)
        and use_triton(x, padding_mask)
    ):
        if _engine(method) == "tensor_cores":
            from kernels.cema.tensor_cores import cema_from_parameters as triton_cema
        else:
            from kernels.cema.triton import cema_from_parameters as triton_cema
        return triton_cema(x, alpha, delta, theta, gamma, omega, bidirectional, padding_mask)
    p, q, g = reference.cema_coefficients(alpha, delta, theta, gamma)
    method = "chunked" if tensor_cores else method
    return reference.cema(x, p, q, g, omega, None, bidirectional, padding_mask, method)[0]
