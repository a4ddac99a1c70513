"""Which implementation runs: Triton kernels for CUDA tensors, the PyTorch references otherwise.

Force the references everywhere with ``MEGA_SUITE_KERNELS=reference`` in the environment or
``kernels.dispatch.force_reference(True)`` (e.g. from a config flag).
"""

from __future__ import annotations

import functools
import os

import torch

_FORCE_REFERENCE: bool | None = None


def force_reference(value: bool | None = True) -> None:
    """True: always the PyTorch references; False: Triton where possible; None: back to the environment."""
    global _FORCE_REFERENCE
    _FORCE_REFERENCE = value


def reference_forced() -> bool:
    if _FORCE_REFERENCE is not None:
        return _FORCE_REFERENCE
    return os.environ.get("MEGA_SUITE_KERNELS", "").lower() == "reference"


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def use_triton(*tensors: torch.Tensor) -> bool:
    """Triton for CUDA tensors unless the reference is forced (or Triton is missing)."""
    if reference_forced() or not triton_available():
        return False
    return all(t is None or t.is_cuda for t in tensors) and any(t is not None and t.is_cuda for t in tensors)
