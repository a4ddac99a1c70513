"""Chunked attention through ``torch.nn.functional.scaled_dot_product_attention`` (flash / cuDNN on a GPU).

For equal head widths without key padding or DropKey: chunks are folded into the batch as strided views
(no mask, so SDPA may pick its fused kernels), and a ragged last chunk runs as a second, shorter call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["chunk_attention"]


def _attend(q: Tensor, k: Tensor, v: Tensor, n: int, c: int, causal: bool) -> Tensor:
    """q, k, v [B, n * c, h, d] -> SDPA on [B * n, h, c, d] -> [B, n * c, h, d]."""
    b, _, h, _ = q.shape
    fold = lambda t: t.reshape(b * n, c, h, t.shape[-1]).transpose(1, 2)  # a view unless t is sliced
    o = F.scaled_dot_product_attention(fold(q), fold(k), fold(v), is_causal=causal, scale=1.0)
    return o.transpose(1, 2).reshape(b, n * c, h, v.shape[-1])


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, chunk_size: int, causal: bool) -> Tensor:
    """Softmax attention (scale 1.0) inside chunks of ``chunk_size`` tokens; q, k, v [B, L, h, d] with one
    head width. Returns [B, L, h, d]."""
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"SDPA chunk_attention expects q, k, v [B, L, h, d] of one shape; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    length = q.shape[1]
    if length == 0:
        return q.new_empty(v.shape)
    c = min(chunk_size, length)
    full, tail = divmod(length, c)
    if not tail:
        return _attend(q, k, v, full, c, causal)
    head = _attend(*(t[:, : full * c] for t in (q, k, v)), full, c, causal) if full else None
    last = _attend(*(t[:, full * c :] for t in (q, k, v)), 1, tail, causal)
    return last if head is None else torch.cat([head, last], dim=1)
