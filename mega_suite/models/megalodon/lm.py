"""Megalodon's causal language model: embed -> blocks -> final TimestepNorm -> output projection, and the
same stream continued segment by segment (docs/architecture.md#language-model, #streaming).

Parameter and buffer names follow the reference release (``layers.{i}.mega.*``, ``layers.{i}.nffn.*``,
``embed``, ``output.final_norm``, ``output.output``), so its state dicts load as they are. A stream continued
by one or two tokens takes the one-token step from packed weights (``step.py``, ``pack.py``), as
``decode.Decoder`` does; ``decode/`` reads this model, this module knows nothing of it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mega_suite.models.common import Backbone, OutputProjection, float32_island, init_all
from mega_suite.models.megalodon.block import MegalodonBlock
from mega_suite.models.megalodon.cache import LayerCache, NormWindow, StreamingCache, advance_windows
from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.models.megalodon.layers import TimestepNorm
from mega_suite.models.megalodon.pack import parameters_may_have_changed, weights_may_have_been_rewritten
from mega_suite.models.megalodon.step import can_step, drop_model_plan, model_plan, stream_step

# A segment of at most this many tokens continues a stream through the packed one-token step, token by
# token; longer ones take the streaming pass, which reads the weights once for all of them
# (bench/reports/2026-11-29-decode-forward.md).
STEP_TOKENS = 2


class OutputHead(nn.Module):
    """Final TimestepNorm and the output projection (reference names ``output.final_norm``, ``output.output``)."""

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        self.final_norm = TimestepNorm(cfg.model_dim, cfg.norm_num_groups, cfg.norm_eps)
        self.output = OutputProjection(cfg.model_dim, cfg.vocab_size, bias=False)


@float32_island("forward", "log_prob", "embed")
class AdaptiveSoftmax(nn.AdaptiveLogSoftmaxWithLoss):
    """Adaptive softmax (Grave et al.) whose bands also serve as the tied adaptive input (Baevski & Auli).

    Band 0 (the ``cutoffs[0]`` most frequent words) embeds with the head's rows at width D; band i embeds
    with the tail's output rows at width D / factor^i and projects up with the (transposed, tied) tail
    projection. Token ids must be sorted by frequency (the WikiText-103 vocabulary is).
    """

    def __init__(self, dim: int, vocab: int, cutoffs: list[int], factor: float):
        if not cutoffs or sorted(cutoffs) != list(cutoffs) or cutoffs[-1] >= vocab:
            raise ValueError(f"adaptive_cutoffs must be increasing and < vocab_size={vocab}, got {cutoffs}")
        super().__init__(dim, vocab, list(cutoffs), div_value=factor, head_bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                std = module.weight.shape[1] ** -0.5  # embedding-like: the rows are also input embeddings
                nn.init.normal_(module.weight, 0.0, std)

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens [B, L] -> [B, L, D]."""
        bounds = [0] + list(self.cutoffs)
        out = tokens.new_zeros(*tokens.shape, self.in_features, dtype=self.head.weight.dtype)
        for i in range(len(bounds) - 1):
            mask = (tokens >= bounds[i]) & (tokens < bounds[i + 1])
            if not mask.any():
                continue
            ids = tokens[mask] - bounds[i]
            if i == 0:
                vec = F.embedding(ids, self.head.weight)
            else:
                proj, rows = self.tail[i - 1][0], self.tail[i - 1][1]
                vec = F.embedding(ids, rows.weight) @ proj.weight  # [n, D/f^i] @ [D/f^i, D]
            out = out.index_put((mask,), vec.to(out.dtype))
        return out

    def token_nll(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL [N] for hidden [N, D], target [N] (all valid)."""
        return -self(hidden, target).output


class MegalodonLM(Backbone):
    """Causal language model: embed -> blocks -> final TimestepNorm -> output projection (docs/architecture.md#language-model)."""

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        if cfg.is_classifier:
            raise ValueError(
                f"MegalodonLM needs num_classes=0, got {cfg.num_classes} (use MegalodonClassifier)"
            )
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.model_dim)
        self.layers = nn.ModuleList(MegalodonBlock(cfg, i) for i in range(cfg.num_layers))
        self.output = OutputHead(cfg)
        if cfg.adaptive_cutoffs:  # adaptive input and softmax share their bands (WikiText-103)
            self.embed = None
            self.output.output = AdaptiveSoftmax(
                cfg.model_dim, cfg.vocab_size, list(cfg.adaptive_cutoffs), cfg.adaptive_factor
            )
        elif cfg.share_emb:
            self.output.output.weight = self.embed.weight
        self.gradient_checkpointing = False
        self.reset_parameters()

    @property
    def adaptive(self) -> bool:
        return self.embed is None

    def train(self, mode: bool = True) -> MegalodonLM:
        """``nn.Module.train``; also stales every packed plan and drops this model's (``pack.py``): weights
        written outside autograd's version counters (``p.data``) are seen after ``model.eval()``."""
        weights_may_have_been_rewritten()
        drop_model_plan(self)
        return super().train(mode)

    def reset_parameters(self) -> None:
        if self.embed is not None:
            std = self.cfg.model_dim**-0.5
            nn.init.trunc_normal_(self.embed.weight, 0.0, std, -3 * std, 3 * std)

    def tie_weights(self) -> None:
        if self.cfg.share_emb and not self.adaptive:
            self.output.output.weight = self.embed.weight

    def init_weights(self) -> None:
        """Re-initialise every parameter and buffer (after ``to_empty`` from the meta device)."""
        self.tie_weights()  # to_empty() unties shared parameters
        init_all(self)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        x = self.output.output.embed(tokens) if self.adaptive else self.embed(tokens)
        if self.cfg.scale_emb:
            x = x * math.sqrt(self.cfg.model_dim)
        return F.dropout(x, self.cfg.dropout, self.training)

    def logits(self, x: Tensor) -> Tensor:
        """Hidden states [..., D] -> logits [..., V] (log-probabilities for the adaptive softmax)."""
        if self.adaptive:
            return self.output.output.log_prob(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        out = self.output.output(x)
        return out if out.dtype == torch.float64 else out.float()

    def token_nll(self, hidden: Tensor, target: Tensor, ignore_index: int = -100) -> Tensor:
        """hidden [B, L, D], target [B, L] -> NLL per token [B, L] (0 where target == ignore_index)."""
        flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
        valid = flat_t != ignore_index
        if self.adaptive:
            dtype = torch.float64 if flat_h.dtype == torch.float64 else torch.float32
            nll = flat_h.new_zeros(flat_t.shape, dtype=dtype)
            if valid.any():
                nll = nll.index_put(
                    (valid,), self.output.output.token_nll(flat_h[valid], flat_t[valid]).to(dtype)
                )
            return nll.view_as(target)
        logits = self.logits(flat_h)
        nll = F.cross_entropy(logits, flat_t.clamp(min=0), reduction="none")
        return (nll * valid).view_as(target)

    def hidden_states(self, tokens: Tensor) -> Tensor:
        """Full pass, no cache: [B, L] -> final normalised hidden states [B, L, D]."""
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(lambda t, m=layer: m(t)[0], x, use_reentrant=False)
            else:
                x, _ = layer(x)
        return self.output.final_norm(x)[0]

    def eval_segment(self) -> int:
        return self.cfg.chunk_size  # one attention chunk: the streaming cache stays O(C)

    def new_cache(self, batch: int, window_stats: bool = False) -> StreamingCache:
        layers = []
        for layer in self.layers:
            norm = layer.mega.timenorm.initial_state(batch)
            # CEMA state None = zeros: the prompt's pass then skips the carried-state terms (no zero work)
            layers.append(LayerCache(norm, None, window=NormWindow(norm) if window_stats else None))
        final = self.output.final_norm.initial_state(batch)
        return StreamingCache(0, layers, final, window_stats, NormWindow(final) if window_stats else None)

    def forward(
        self, tokens: Tensor, cache: StreamingCache | None = None, use_cache: bool = False
    ) -> tuple[Tensor, StreamingCache | None]:
        """tokens [B, L] -> (logits [B, L, V] float32, cache).

        With ``cache`` (or ``use_cache=True``) the call continues a stream: any split of a sequence into
        segments gives the same logits as one full pass. Segments may have any length; one of at most
        ``STEP_TOKENS`` tokens in evaluation without autograd runs the packed one-token step per token
        (docs/long_context.md#the-one-token-step), float32 whatever the autocast.
        """
        plan = self._step_plan(tokens, cache, use_cache)
        if plan is not None:
            x, cache = self._steps(plan, tokens, cache)
            with torch.autocast(tokens.device.type, enabled=False):  # float32 logits
                return plan.head(x.flatten(0, 1)).view(*x.shape[:2], -1), cache
        x, cache = self.forward_hidden(tokens, cache, use_cache)
        return self.logits(x), cache

    def forward_hidden(
        self, tokens: Tensor, cache: StreamingCache | None = None, use_cache: bool = False
    ) -> tuple[Tensor, StreamingCache | None]:
        """Like ``forward`` but returns the final normalised hidden states [B, L, D] (for losses)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, L], got shape {tuple(tokens.shape)}")
        if cache is None and not use_cache:
            return self.hidden_states(tokens), None
        plan = self._step_plan(tokens, cache, use_cache)
        if plan is not None:
            return self._steps(plan, tokens, cache)
        parameters_may_have_changed()  # a full pass: every plan re-lists the parameter objects once
        if cache is None:
            cache = self.new_cache(tokens.shape[0])
        outs = []
        for piece in self._pieces(tokens.shape[1], cache):
            out, cache = self._stream_piece(tokens[:, piece], cache)
            outs.append(out)
        if not outs:
            dtype = self.output.final_norm.weight.dtype
            return tokens.new_zeros(tokens.shape[0], 0, self.cfg.model_dim, dtype=dtype), cache
        return torch.cat(outs, 1), cache

    def _step_plan(self, tokens: Tensor, cache: StreamingCache | None, use_cache: bool):
        """The packed plan when this call continues a stream by 1..``STEP_TOKENS`` tokens through the
        one-token step (evaluation mode, no autograd, ``step.can_step``), else None."""
        if (cache is None and not use_cache) or tokens.dim() != 2 or not 0 < tokens.shape[1] <= STEP_TOKENS:
            return None
        if self.training or not can_step(self):  # training mode: dropout, which the step leaves out
            return None
        return model_plan(self)

    def _steps(self, plan, tokens: Tensor, cache: StreamingCache | None) -> tuple[Tensor, StreamingCache]:
        """tokens [B, L] one packed step each -> (final normalised hidden states [B, L, D], cache)."""
        if cache is None:
            cache = self.new_cache(tokens.shape[0])
        outs = []
        for i in range(tokens.shape[1]):
            x, cache = stream_step(self, plan, tokens[:, i], cache)
            outs.append(x)
        return torch.stack(outs, 1), cache

    def _pieces(self, length: int, cache: StreamingCache) -> list[slice]:
        """Cut a segment so that no piece crosses a chunk boundary unless it starts on one."""
        c = self.cfg.chunk_size
        pieces, start, pos = [], 0, cache.position
        while start < length:
            offset = pos % c
            if offset:
                n = min(c - offset, length - start)
            elif cache.window_stats:
                n = min(c, length - start)  # one chunk at a time: statistics are recorded per chunk
            else:
                n = length - start
            pieces.append(slice(start, start + n))
            start += n
            pos += n
        return pieces

    def _stream_piece(self, tokens: Tensor, cache: StreamingCache) -> tuple[Tensor, StreamingCache]:
        pos = cache.position
        x = self.embed_tokens(tokens)
        new_layers = []
        for layer, lc in zip(self.layers, cache.layers):
            x, lc = layer(x, cache=lc, pos=pos)
            new_layers.append(lc)
        x, final_state = self.output.final_norm(x, cache.final_norm)
        end = pos + tokens.shape[1]
        new = StreamingCache(end, new_layers, final_state, cache.window_stats, cache.final_window)
        if cache.window_stats and end % self.cfg.chunk_size == 0:
            advance_windows(new, self.cfg.chunk_size)
        return x, new
