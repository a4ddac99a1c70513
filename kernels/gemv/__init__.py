"""One-row GEMV for decoding: y = W · round(x) + b + a, accumulated in float32.

A decode step reads every weight once per token, so its floor is the weights' bytes over the memory
bandwidth, and the GEMVs are almost all of its time. For one row x [I] (float32 activations) and a weight
W [O, I] stored in a low-precision dtype (bfloat16 for decoding), ``row_gemv`` returns the float32 vector

    y_o = Σ_i W[o, i] · round(x_i) + b_o + a_o        (round: x cast to W's dtype, as a bf16 GEMV reads it)

with optional bias b [O] and addend a [O] (a residual folded into the GEMV), the sum in float32.

Implementations:
- ``kernels.gemv.triton``: a Triton kernel (a block of rows per program, the input width looped in tiles,
  the bias / addend in the epilogue), autotuned per (O, I); registered as the custom op
  ``mega_suite::row_gemv`` so that ``torch.compile`` keeps it one opaque kernel;
- ``mega_suite::mv`` (here): ``torch.mv`` behind a custom op, so that ``torch.compile`` keeps the vendor
  GEMV (cuBLAS) instead of rewriting it as its own reduction;
- ``kernels.gemv.reference``: the readable PyTorch form (tests, CPU).

``decode.Gemv`` picks one for one-row CUDA GEMVs (``decode.CUDA_ROW_GEMV``); bench/decode_gpu.py measures
them side by side.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import dispatch
from kernels.gemv import reference

__all__ = ["row_gemv", "mv"]


def row_gemv(w: Tensor, x: Tensor, bias: Tensor | None = None, add: Tensor | None = None) -> Tensor:
    """w [O, I] (float16 / bfloat16 / float32), x [I] float32, bias / add [O] float32 or None -> y [O]
    float32 (module docstring). The Triton kernel for CUDA tensors (``kernels.dispatch``), else the
    reference."""
    if dispatch.use_triton(w, x, bias, add):
        from kernels.gemv import triton as fused  # imports Triton only when it runs

        return fused.row_gemv_op(w, x, bias, add)  # the custom op mega_suite::row_gemv
    return reference.row_gemv(w, x, bias, add)


@torch.library.custom_op("mega_suite::mv", mutates_args=())
def _mv_op(w: Tensor, x: Tensor) -> Tensor:
    return torch.mv(w, x)


@_mv_op.register_fake
def _(w, x):
    return w.new_empty(w.shape[0])


def mv(w: Tensor, x: Tensor) -> Tensor:
    """torch.mv(w, x) that torch.compile leaves to the vendor library (an opaque custom op)."""
    return torch.ops.mega_suite.mv(w, x)
