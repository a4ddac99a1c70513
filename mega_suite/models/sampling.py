"""Sampling from a language model: one next token from logits (greedy, temperature, top-k, top-p), and the
loop every decoder shares (``sample_loop``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """logits [B, V] -> token ids [B]."""
    if greedy or temperature == 0.0:
        return logits.argmax(-1)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float() / temperature
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_prompt(prompt: Tensor) -> None:
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty [B, L] tensor, got shape {tuple(prompt.shape)}")


def sample_loop(
    prompt: Tensor,
    logits: Tensor,
    advance: Callable[[Tensor], Tensor],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    stop: Callable[[Tensor], bool] | None = None,
) -> Tensor:
    """Sample up to ``max_new_tokens`` tokens after ``prompt`` [B, L], whose last logits are ``logits[:, -1]``;
    ``advance(tokens [B])`` feeds one token per row to the decoder and returns its logits [B, 1, V]. With
    ``eos_id`` a finished row repeats it and the loop ends when every row has; ``stop(out)``, given the tokens
    so far, ends it when True (a stop string). Returns [B, L + new]."""
    out = [prompt]
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        nxt = sample_next(logits[:, -1], temperature, top_k, top_p, greedy, generator)
        if eos_id is not None:
            nxt = torch.where(finished, torch.full_like(nxt, eos_id), nxt)
            finished |= nxt == eos_id
        out.append(nxt[:, None])
        if eos_id is not None and bool(finished.all()):
            break
        if stop is not None and stop(torch.cat(out, 1)):
            break
        logits = advance(nxt)
    return torch.cat(out, 1)
