"""The one-row GEMV in plain PyTorch (see ``kernels.gemv``): y = W · round(x) + b + a in float32."""

from __future__ import annotations

from torch import Tensor


def row_gemv(w: Tensor, x: Tensor, bias: Tensor | None = None, add: Tensor | None = None) -> Tensor:
    """w [O, I], x [I] float32 (rounded to w's dtype first), bias / add [O] or None -> [O] float32."""
    y = w.float() @ x.to(w.dtype).float()
    if bias is not None:
        y = y + bias
    return y if add is None else y + add
