"""Generating text with a Megalodon language model: the streaming prompt pass, then one sampled token at a
time through the packed step (``Decoder``) or its fixed-buffer form (``StaticDecoder``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mega_suite.models.megalodon.decode.decoder import Decoder
from mega_suite.models.megalodon.decode.static import StaticDecoder
from mega_suite.models.sampling import check_prompt, sample_loop


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
    check_prompt(prompt)
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

    return sample_loop(
        prompt, logits, advance, max_new_tokens, temperature, top_k, top_p, greedy, eos_id, generator, stop
    )
