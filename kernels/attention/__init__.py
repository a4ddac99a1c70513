"""Chunked normalised attention (docs/architecture.md#normalised-attention).

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
from kernels.attention.step import attention_step

__all__ = ["chunk_attention", "attention_with_cache", "attention_step", "fused_eligible"]

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_QK_HEAD_DIM = 256  # the fused kernel keeps a [BLOCK, dk] tile per program (kernels.attention.triton)


def fused_eligible(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the fused kernel supports these inputs, the device aside: q, k, v [B, L, h, d] in one of
    float16 / bfloat16 / float32 (one dtype for all three) and a Q/K head width <= 256. On CUDA (and unless
    the reference is forced, ``kernels.dispatch``) eligible inputs take the Triton path."""
    return (
        q.dtype in _TRITON_DTYPES
        and k.dtype == q.dtype == v.dtype
        and q.dim() == 4
        and q.shape[-1] <= _MAX_QK_HEAD_DIM
    )


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
    if fused_eligible(q, k, v) and dispatch.use_triton(q, k, v):
        from kernels.attention import triton as fused  # imports Triton only when it runs

        return fused.chunk_attention(q, k, v, chunk_size, causal, key_padding_mask, dropout_p)
    return reference.chunk_attention(q, k, v, chunk_size, causal, key_padding_mask, dropout_p)
