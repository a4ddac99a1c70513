"""Generating text with a Megalodon language model: the streaming prompt pass, then one sampled token at a
time through the packed step (``Decoder``) or its fixed-buffer form (``StaticDecoder``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mega_suite.models.megalodon.decode.decoder import Decoder
from mega_suite.models.megalodon.decode.static import StaticDecoder
from mega_suite.models.sampling import sample_next


@torch.no_grad()
def generate(
    source: Decoder | nn.Module,
    prompt: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    eos_id: int | None = None,
    window_stats: bool = False,
    generator: torch.Generator | None = None,
    static: bool = False,
    compile: bool = False,
    stop: Callable[[Tensor], bool] | None = None,
) -> Tensor:
    """Continue ``prompt`` [B, L] by up to ``max_new_tokens`` tokens; returns [B, L + new].

    ``source``: a ``Decoder`` (its packs' dtypes) or a ``MegalodonLM`` (float32 packs). Memory is bounded by
    the chunk size, not the context length. ``static``: decode through a ``StaticDecoder`` (fixed buffers; a
    CUDA graph per step on a GPU); ``compile``: the same, its step compiled by torch.compile first (the
    fastest CPU path). Both need a float32, unsharded, non-adaptive model and no ``window_stats``.
    ``stop(out)``: called with the tokens so far after each new one; True ends generation (a stop string).
    """
    dec = source if isinstance(source, Decoder) else Decoder(source)
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty [B, L] tensor, got shape {tuple(prompt.shape)}")
    if (static or compile) and window_stats:
        raise ValueError("static / compiled decoding does not support window_stats")
    cache = dec.model.new_cache(prompt.shape[0], window_stats)
    logits, cache = dec(prompt, cache)
    if static or compile:
        fixed = StaticDecoder(dec, cache, compile=compile)

        def advance(tokens: Tensor) -> Tensor:
            return fixed.step(tokens).unsqueeze(1)
    else:

        def advance(tokens: Tensor) -> Tensor:
            nonlocal cache
            logits, cache = dec(tokens[:, None], cache)
            return logits

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
