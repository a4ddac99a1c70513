"""Chunked normalised attention (SPEC §4).

``chunk_attention`` runs the fused Triton kernels (``kernels.attention.triton``, DropKey for attention
dropout) for CUDA tensors they support, and the PyTorch reference (``kernels.attention.reference``,
DropKey through the attention mask) otherwise -- see ``kernels.dispatch``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import dispatch
from kernels.attention import reference
from kernels.attention.reference import attention_with_cache

__all__ = ["chunk_attention", "attention_with_cache"]

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def chunk_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    chunk_size: int,
    causal: bool,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Softmax attention inside independent chunks of ``chunk_size`` tokens.

    Args:
        q, k: [B, L, h, dk] (RoPE already applied, positions restarting per chunk).
        v: [B, L, h, dv]; dv may differ from dk.
        chunk_size: C; a length that is not a multiple of C is padded internally.
        causal: mask keys after the query inside each chunk.
        key_padding_mask: [B, L] bool, True = padding key.
        dropout_p: DropKey rate (pre-softmax logits masked with this probability, no rescaling).

    Returns:
        [B, L, h, dv]; a query with no valid key outputs zeros.
    """
    if (
        dispatch.use_triton(q, k, v)
        and q.dtype in _TRITON_DTYPES
        and k.dtype == q.dtype == v.dtype
        and q.dim() == 4
        and q.shape[-1] <= 256
    ):
        from kernels.attention import triton as fused  # imports Triton only when it runs

        return fused.chunk_attention(q, k, v, chunk_size, causal, key_padding_mask, dropout_p)
    return reference.chunk_attention(q, k, v, chunk_size, causal, key_padding_mask, dropout_p)
