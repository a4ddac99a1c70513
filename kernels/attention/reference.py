"""Chunked (block-diagonal) attention, SPEC §4, in plain PyTorch.

Chunks are folded into the batch and handed to ``scaled_dot_product_attention`` with scale 1.0
(Q and K arrive normalised and learnably scaled). Cost O(L * C) in time and memory.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["chunk_attention", "attention_with_cache"]


def _fold(t: Tensor, nc: int, c: int) -> Tensor:
    """[B, nc*c, h, d] -> [B*nc, h, c, d]."""
    b, _, h, d = t.shape
    return t.reshape(b, nc, c, h, d).permute(0, 1, 3, 2, 4).reshape(b * nc, h, c, d)


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
        dropout_p: dropout on the attention probabilities (callers pass 0 in eval).

    Returns:
        [B, L, h, dv]; a query with no valid key outputs zeros.
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"chunk_attention expects q, k [B, L, h, dk] and v [B, L, h, dv]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, length, h, _ = q.shape
    dv = v.shape[-1]
    c = min(chunk_size, length)
    nc = math.ceil(length / c)
    pad = nc * c - length
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        if key_padding_mask is None:
            key_padding_mask = torch.zeros(b, length, dtype=torch.bool, device=q.device)
        key_padding_mask = F.pad(key_padding_mask, (0, pad), value=True)
    qf, kf, vf = _fold(q, nc, c), _fold(k, nc, c), _fold(v, nc, c)

    mask = None
    no_key = None
    if key_padding_mask is not None:
        keep = ~key_padding_mask.reshape(b * nc, 1, 1, c)  # True = attend
        if causal:
            keep = keep & torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        # A row with no valid key would give NaN: let it attend anywhere, then zero it.
        no_key = ~keep.any(-1, keepdim=True)  # [B*nc, 1, c or 1, 1]
        mask = keep | no_key
        o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, dropout_p=dropout_p, scale=1.0)
        o = o.masked_fill(no_key, 0.0)
    else:
        o = F.scaled_dot_product_attention(qf, kf, vf, dropout_p=dropout_p, is_causal=causal, scale=1.0)
    o = o.reshape(b, nc, h, c, dv).permute(0, 1, 3, 2, 4).reshape(b, nc * c, h, dv)
    return o[:, :length] if pad else o


def attention_with_cache(q: Tensor, k: Tensor, v: Tensor, cache_len: int) -> Tensor:
    """Causal attention of new queries over [cached ; new] keys of the same chunk (streaming).

    q: [B, l, h, dk] for positions cache_len..cache_len+l-1 of the chunk; k, v: [B, cache_len + l, h, *].
    Returns [B, l, h, dv].
    """
    length = q.shape[1]
    total = k.shape[1]
    qi = torch.arange(length, device=q.device).view(length, 1) + cache_len
    mask = torch.arange(total, device=q.device).view(1, total) <= qi
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=1.0
    )
    return o.transpose(1, 2)
