"""One ``generate`` for any registered language model: Megalodon's streaming decoder
(``megalodon.decode``) or Llama's key / value cache inside its window (``llama.decode``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from mega_suite.models.llama.decode import LlamaDecoder
from mega_suite.models.llama.decode import generate as llama_generate
from mega_suite.models.megalodon.decode import generate as megalodon_generate
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
    """Continue ``prompt`` [B, L] by up to ``max_new_tokens`` tokens ([B, L + new]); ``compile``: Megalodon's
    compiled ``StaticDecoder``."""
    kwargs = dict(
        temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy, eos_id=eos_id,
        generator=generator, stop=stop,
    )  # fmt: skip
    name = arch_of(model.cfg).name
    if name == "megalodon":
        return megalodon_generate(model, prompt, max_new_tokens, compile=compile, **kwargs)
    if name == "llama":
        if compile:
            raise ValueError("compile=true applies to Megalodon's static decoder; Llama decodes eagerly")
        return llama_generate(model, prompt, max_new_tokens, **kwargs)
    raise ValueError(f"no decoder for model.arch={name!r}")


def context_seen(model: nn.Module, position: int) -> int:
    """How many tokens the prediction at ``position`` (0-based) is computed from: all of them for Megalodon,
    the window's for Llama (``LlamaDecoder.context_start``)."""
    if arch_of(model.cfg).name == "llama":
        return position + 1 - LlamaDecoder(model).context_start(position)
    return position + 1
