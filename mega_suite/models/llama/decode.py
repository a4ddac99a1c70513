"""Generating text with the Llama baseline: a key / value cache inside its context window.

A Transformer sees at most ``max_seq_len`` tokens. The decoder keeps the window of the model's streaming
evaluation (``model.py``): positions are grouped in blocks of ``stride`` at absolute multiples of the stride,
and position ``t`` is computed from the tokens ``[lo(t), t]`` with ``lo(t) = max(0, (t // stride) * stride -
(max_seq_len - stride))``: every earlier token while the sequence fits the window, then between
``max_seq_len - stride`` and ``max_seq_len - 1`` of them. While ``lo`` stays put each new token's keys and
values are appended to the cache; when it moves (every ``stride`` tokens, past the window) the cache is
rebuilt by one pass over the window's tokens. So each logit is a full forward pass's over exactly the tokens
``context_start`` names, and generation scores as streaming evaluation does (docs/long_context.md#decoding).

The decoder reads the model's weights (``LlamaLM``); the model never imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mega_suite.models.common import autocast_input, rope
from mega_suite.models.sampling import check_prompt, sample_loop


@dataclass
class KVCache:
    """The decoder's state: token ids from ``lo`` (at most one window), per layer keys and values [B, h, T, hd]
    at positions ``0 .. T - 1`` relative to ``lo``, and the absolute position of the next token."""

    tokens: Tensor  # [B, T]
    lo: int
    layers: list[tuple[Tensor, Tensor]]
    position: int

    def memory_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers) + self.tokens.numel() * 8


class LlamaDecoder:
    """``dec(tokens, cache) -> (logits [B, L, V] float32, cache)`` for a ``LlamaLM``; see the module docstring."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.window = model.cfg.max_seq_len
        self.stride = model.cfg.stride

    def context_start(self, t: int) -> int:
        """The first token position ``t`` sees."""
        return max(0, (t // self.stride) * self.stride - (self.window - self.stride))

    @torch.no_grad()
    def __call__(self, tokens: Tensor, cache: KVCache | None = None) -> tuple[Tensor, KVCache]:
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must be a non-empty [B, L] tensor, got shape {tuple(tokens.shape)}")
        if cache is None:
            empty = tokens.new_zeros(tokens.shape[0], 0)
            cache = KVCache(empty, 0, [], 0)
        outs = []
        done = 0
        while done < tokens.shape[1]:
            t = cache.position
            lo = self.context_start(t)
            n = 1  # the run of new positions that share this lo
            while done + n < tokens.shape[1] and self.context_start(t + n) == lo:
                n += 1
            piece = tokens[:, done : done + n]
            if lo != cache.lo or not cache.layers:  # a new window: one pass over its tokens
                known = cache.tokens[:, lo - cache.lo :] if lo >= cache.lo else None
                if known is None or known.shape[1] != t - lo:
                    raise ValueError(f"cache holds tokens from {cache.lo}, the window needs them from {lo}")
                cache = KVCache(known, lo, [], t)
                x, cache = self._forward(torch.cat([known, piece], 1), cache, start=0)
                x = x[:, known.shape[1] :]
            else:
                x, cache = self._forward(piece, cache, start=t - lo)
            outs.append(self.model.logits(x))
            cache = KVCache(torch.cat([cache.tokens, piece], 1), lo, cache.layers, t + n)
            done += n
        return torch.cat(outs, 1), cache

    def _forward(self, tokens: Tensor, cache: KVCache, start: int) -> tuple[Tensor, KVCache]:
        """Blocks over ``tokens`` at window positions ``start ..``, keys and values appended to ``cache``'s."""
        model, cfg = self.model, self.model.cfg
        x = model.embed(tokens)
        b, length, _ = x.shape
        positions = torch.arange(start, start + length, device=x.device)
        mask = None
        if start > 0 and length > 1:  # new queries see every cached key and the new ones up to themselves
            keys = torch.arange(start + length, device=x.device)
            mask = keys[None, :] <= positions[:, None]
        layers = []
        for i, block in enumerate(model.layers):
            a = block.attention
            u = autocast_input(block.attention_norm(x))
            q, k, v = (w(u).view(b, length, cfg.num_heads, cfg.head_dim) for w in (a.wq, a.wk, a.wv))
            q, k = rope(q, positions, cfg.rope_base), rope(k, positions, cfg.rope_base)
            q, k, v = (t.to(v.dtype).transpose(1, 2) for t in (q, k, v))
            if cache.layers:
                k = torch.cat([cache.layers[i][0], k], 2)
                v = torch.cat([cache.layers[i][1], v], 2)
            if mask is not None:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:  # a fresh window is causal; one new query sees every key
                o = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0 and length > 1)
            h = x + a.wo(o.transpose(1, 2).reshape(b, length, -1))
            x = h + block.feed_forward(autocast_input(block.ffn_norm(h)))
            layers.append((k, v))
        return model.final_norm(x), KVCache(cache.tokens, cache.lo, layers, cache.position)


@torch.no_grad()
def generate(
    source: LlamaDecoder | nn.Module,
    prompt: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    stop: Callable[[Tensor], bool] | None = None,
) -> Tensor:
    """Continue ``prompt`` [B, L] by up to ``max_new_tokens`` tokens; returns [B, L + new]. The arguments are
    those of Megalodon's ``generate``; ``stop(out)`` ends generation early when it returns True."""
    dec = source if isinstance(source, LlamaDecoder) else LlamaDecoder(source)
    check_prompt(prompt)
    logits, cache = dec(prompt)

    def advance(tokens: Tensor) -> Tensor:
        nonlocal cache
        logits, cache = dec(tokens[:, None], cache)
        return logits

    return sample_loop(
        prompt, logits, advance, max_new_tokens, temperature, top_k, top_p, greedy, eos_id, generator, stop
    )
