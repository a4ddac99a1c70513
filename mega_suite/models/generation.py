"""One ``generate`` for any registered language model: the decoder its architecture's spec names
(Megalodon's streaming decoder, Llama's key / value cache inside its window)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mega_suite.models.registry import arch_of


def generate(
    model: nn.Module,
    prompt: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    stop: Callable[[Tensor], bool] | None = None,
    compile: bool = False,
) -> Tensor:
    """Continue ``prompt`` [B, L] by up to ``max_new_tokens`` tokens ([B, L + new]); ``compile``: a compiled
    static decoder where the architecture has one (Megalodon's ``StaticDecoder``)."""
    return arch_of(model.cfg).generate(
        model, prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
        eos_id=eos_id, generator=generator, stop=stop, compile=compile,
    )  # fmt: skip


def context_seen(model: nn.Module, position: int) -> int:
    """How many tokens the prediction at ``position`` (0-based) is computed from: all of them for Megalodon,
    the window's for Llama."""
    return arch_of(model.cfg).context_seen(model, position)
