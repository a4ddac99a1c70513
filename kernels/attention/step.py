"""Attention of one new query over the keys and values of its chunk (decoding), beside the chunked forms in
``reference.py`` and ``triton.py``."""

from __future__ import annotations

import torch
from torch import Tensor


def attention_step(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q kᵀ) v of one query per row: q [B, 1, h, zd] float32 (scaled), keys [B, n, h, zd], values
    [B, n, h, E/h], ``mask`` [n] bool (True = a row not yet written: −inf) or None -> [B, h, 1, E/h] float32.

    Keys and values stored in bf16 on the CPU are never multiplied in bf16 over a length that changes at every
    token: oneDNN would build a kernel for every new shape (bench/reports/2026-11-24-bf16-kv-decode.md). Eager, they
    are cast to float32. Compiled (the StaticDecoder's CPU buckets make n one of C/64 lengths), the scores are
    float32 reductions with the bf16 loads fused, and for one row and one head softmax(·) v is a bf16 matmul
    over the bucketed length (float32 accumulation). On CUDA the query is rounded to the keys' dtype instead.
    """
    if keys.dtype != q.dtype:
        if keys.device.type != "cpu":
            q = q.to(keys.dtype)
        elif torch.compiler.is_compiling():
            scores = (keys.float() * q).sum(-1).transpose(1, 2).unsqueeze(2)  # [B, h, 1, n] float32
            if mask is not None:
                scores = scores.masked_fill(mask, float("-inf"))
            probs = torch.softmax(scores, -1)
            if keys.shape[0] * keys.shape[2] == 1:  # a 2-D product: oneDNN's (as below)
                probs = probs.view(1, -1).to(values.dtype)
                return (probs @ values.view(values.shape[1], -1)).float().view(1, 1, 1, -1)
            # batched: Inductor decomposes a one-row bf16 bmm into bf16 arithmetic (4 ulps off); reductions
            return (probs.squeeze(2).transpose(1, 2).unsqueeze(-1) * values.float()).sum(1).unsqueeze(2)
        else:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
    bsz, n, h, zd = keys.shape
    if bsz * h == 1:  # 2-D GEMVs: torch.compile keeps them BLAS calls, a one-row bmm it lowers to a loop
        scores = q.reshape(1, zd) @ keys.reshape(n, zd).t()
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        return (torch.softmax(scores, -1) @ values.reshape(n, -1)).float().view(1, 1, 1, -1)
    scores = torch.matmul(q.transpose(1, 2), keys.permute(0, 2, 3, 1))  # [B, h, 1, n]
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), values.transpose(1, 2)).float()
