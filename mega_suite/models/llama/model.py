"""Llama-2 decoder, the Transformer baseline of the paper's head-to-head (its Figures 1 and 5).

    h   = x + W_o Attn(RoPE(W_q u), RoPE(W_k u), W_v u),   u = RMSNorm(x)      (pre-norm)
    out = h + W_2 (SiLU(W_1 v) ⊙ W_3 v),                   v = RMSNorm(h)      (SwiGLU)

RMSNorm(x) = x / sqrt(mean(x²) + eps) · w (w initialised to 1, Llama's convention); causal softmax
attention with scale 1/sqrt(d_head) over a fixed context window (``max_seq_len``); RoPE on interleaved pairs
(as Meta's reference code) with base 10000; no biases; embedding → blocks → final RMSNorm → output
projection, optionally tied to the embedding. Initialisation as torchtitan's Llama: trunc-normal std 0.02 for
the input projections, depth-scaled 0.02 / sqrt(2 (layer + 1)) for W_o, W_2, W_3, N(0, 1) embeddings and
D^-1/2 for the output; tied, the one matrix gets GPT-2's std 0.02.

Beyond its window a Transformer has no state: streaming evaluation (``forward_hidden`` with a cache, as
``CausalLM`` and ``mode=eval_context`` call it) scores each token with a **sliding window**: a segment is cut
into blocks of ``eval_stride`` tokens at absolute multiples of the stride, and every block is encoded
afresh after the ``max_seq_len - eval_stride`` tokens that precede it, so each token sees between
``max_seq_len - eval_stride`` and ``max_seq_len - 1`` earlier tokens (the usual sliding-window perplexity;
stride ``max_seq_len // 2`` by default), whatever the split into segments. The cache holds the last
``max_seq_len - 1`` token ids, nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mega_suite.models.common import Backbone, OutputProjection, RMSNorm, autocast_input, init_all, rope
from mega_suite.models.llama.config import LlamaConfig


def _trunc_normal(weight: Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, 0.0, std, -3 * std, 3 * std)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_index: int):
        super().__init__()
        d = cfg.model_dim
        self.cfg, self.layer_index = cfg, layer_index
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.wq, self.wk, self.wv):
            _trunc_normal(w.weight, 0.02)
        _trunc_normal(self.wo.weight, 0.02 / math.sqrt(2 * (self.layer_index + 1)))

    def forward(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        h, hd = self.cfg.num_heads, self.cfg.head_dim
        q, k, v = (w(x).view(b, length, h, hd) for w in (self.wq, self.wk, self.wv))
        positions = torch.arange(length, device=x.device)
        q, k = rope(q, positions, self.cfg.rope_base), rope(k, positions, self.cfg.rope_base)
        # One dtype for the three (bf16 under autocast: rope returns its input's dtype, v is a Linear output).
        q, k = q.to(v.dtype), k.to(v.dtype)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(o.transpose(1, 2).reshape(b, length, -1))


class LlamaFFN(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_index: int):
        super().__init__()
        d, f = cfg.model_dim, cfg.ffn_hidden_dim
        self.layer_index = layer_index
        self.w1, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _trunc_normal(self.w1.weight, 0.02)
        std = 0.02 / math.sqrt(2 * (self.layer_index + 1))
        _trunc_normal(self.w2.weight, std)
        _trunc_normal(self.w3.weight, std)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: h = x + Attn(RMSNorm(x)); out = h + FFN(RMSNorm(h))."""

    def __init__(self, cfg: LlamaConfig, layer_index: int = 0):
        super().__init__()
        self.cfg = cfg
        self.attention_norm = RMSNorm(cfg.model_dim, cfg.norm_eps, plus_one=False)
        self.attention = LlamaAttention(cfg, layer_index)
        self.ffn_norm = RMSNorm(cfg.model_dim, cfg.norm_eps, plus_one=False)
        self.feed_forward = LlamaFFN(cfg, layer_index)

    def forward(self, x: Tensor) -> Tensor:
        p, train = self.cfg.dropout, self.training
        # the norms' outputs in the Linears' autocast dtype once: W_q, W_k, W_v (W_1, W_3) store one copy
        h = x + F.dropout(self.attention(autocast_input(self.attention_norm(x))), p, train)
        return h + F.dropout(self.feed_forward(autocast_input(self.ffn_norm(h))), p, train)


@dataclass
class WindowCache:
    """Streaming state of the sliding-window evaluation: the last ``max_seq_len - 1`` token ids."""

    tokens: Tensor  # [B, <= max_seq_len - eval_stride]
    position: int = 0  # tokens consumed so far

    def memory_bytes(self) -> int:
        return self.tokens.numel() * self.tokens.element_size()


class LlamaLM(Backbone):
    """Causal Llama-2 language model with the interface ``CausalLM`` uses (``forward_hidden``, ``token_nll``)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.model_dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.model_dim, cfg.norm_eps, plus_one=False)
        self.output = OutputProjection(cfg.model_dim, cfg.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.tie_weights()
        self.reset_parameters()

    def tie_weights(self) -> None:
        if self.cfg.share_emb:
            self.output.weight = self.embed.weight

    def reset_parameters(self) -> None:
        d = self.cfg.model_dim
        if self.cfg.share_emb:
            # GPT-2 / nanoGPT's tied init: with small residual branches at init the last hidden state is
            # nearly the input token's own embedding, so a larger std gives that token a logit of
            # ~sqrt(D) * |row| (initial loss 13.9 instead of ln V = 8.3 at D 256 with std D^-1/2).
            _trunc_normal(self.embed.weight, 0.02)
        else:
            nn.init.normal_(self.embed.weight, 0.0, 1.0)
            _trunc_normal(self.output.weight, d**-0.5)

    def init_weights(self) -> None:
        """Re-initialise every parameter (after ``to_empty`` from the meta device)."""
        self.tie_weights()
        init_all(self)

    def eval_segment(self) -> int:
        return self.cfg.stride  # one sliding-window block per call

    # ------------------------------------------------------------------ full passes
    def hidden_states(self, tokens: Tensor) -> Tensor:
        """[B, L <= max_seq_len] -> final normalised hidden states [B, L, D]."""
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"Llama's context window is model.max_seq_len={self.cfg.max_seq_len} tokens, got a sequence "
                f"of {tokens.shape[1]}: raise max_seq_len or evaluate with the sliding window (use_cache=True)"
            )
        x = F.dropout(self.embed(tokens), self.cfg.dropout, self.training)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.final_norm(x)

    def logits(self, x: Tensor) -> Tensor:
        """Hidden states [..., D] -> logits [..., V], computed in float32 (float64 for a float64 model)."""
        return self.output(x)

    def token_nll(self, hidden: Tensor, target: Tensor, ignore_index: int = -100) -> Tensor:
        """hidden [B, L, D], target [B, L] -> NLL per token [B, L] (0 where target == ignore_index)."""
        logits = self.logits(hidden.reshape(-1, hidden.shape[-1]))
        flat = target.reshape(-1)
        nll = F.cross_entropy(logits, flat.clamp(min=0), reduction="none")
        return (nll * (flat != ignore_index)).view_as(target)

    def forward(
        self, tokens: Tensor, cache: WindowCache | None = None, use_cache: bool = False
    ) -> tuple[Tensor, WindowCache | None]:
        """tokens [B, L] -> (logits [B, L, V] float32, cache); see ``forward_hidden``."""
        x, cache = self.forward_hidden(tokens, cache, use_cache)
        return self.logits(x), cache

    def forward_hidden(
        self, tokens: Tensor, cache: WindowCache | None = None, use_cache: bool = False
    ) -> tuple[Tensor, WindowCache | None]:
        """Without a cache: one pass over at most ``max_seq_len`` tokens. With one (or ``use_cache``): the
        sliding-window stream of the module docstring, for segments of any length."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, L], got shape {tuple(tokens.shape)}")
        if cache is None and not use_cache:
            return self.hidden_states(tokens), None
        if cache is None:
            cache = WindowCache(tokens.new_zeros(tokens.shape[0], 0))
        window, stride = self.cfg.max_seq_len, self.cfg.stride
        stream = torch.cat([cache.tokens, tokens], 1)
        base = cache.position - cache.tokens.shape[1]  # absolute position of stream[:, 0]
        s, outs = cache.tokens.shape[1], []
        while s < stream.shape[1]:
            block = (base + s) // stride * stride  # blocks sit at absolute multiples of the stride
            e = min(stream.shape[1], block + stride - base)
            lo = max(0, block - (window - stride) - base)
            outs.append(self.hidden_states(stream[:, lo:e])[:, s - lo :])
            s = e
        hidden = torch.cat(outs, 1) if outs else self.final_norm(self.embed(tokens))
        # A block continued by the next segment needs up to window - 1 tokens of context.
        new = WindowCache(
            stream[:, max(0, stream.shape[1] - (window - 1)) :], cache.position + tokens.shape[1]
        )
        return hidden, new
