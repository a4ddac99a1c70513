"""Megalodon's attention layer: TimestepNorm -> CEMA -> normalised chunk attention with a gated output
(the first half of the block, docs/architecture.md#the-block)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.attention import attention_with_cache, chunk_attention
from kernels.qk_norm_rope import qk_norm_rope
from mega_suite.models.common import RMSNorm, autocast_input
from mega_suite.models.megalodon.cache import ChunkKV, LayerCache
from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.models.megalodon.layers import ComplexEMA, Linear, TimestepNorm
from mega_suite.models.megalodon.lean import rebuild_linear, recompute_saved, silu_gate_linear


class MegalodonAttention(nn.Module):
    """TimestepNorm -> CEMA -> normalised chunk attention with gated output (docs/architecture.md#the-block, first half)."""

    no_weight_decay_params = ("gamma", "beta")  # the Q/K scales and offsets

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        self.cfg = cfg
        d, z, e, h = cfg.model_dim, cfg.z_dim, cfg.value_dim, cfg.num_heads
        causal = not cfg.is_classifier
        self.causal = causal
        self.timenorm = TimestepNorm(d, cfg.norm_num_groups, cfg.norm_eps, causal=causal)
        self.cema = ComplexEMA(d, cfg.cema_ndim, bidirectional=not causal, method=cfg.cema_method)
        self.rmsnorm = RMSNorm(d, cfg.norm_eps, lean=True)  # W_z, W_r, W_h1 keep its output
        self.wz = Linear(d, z)
        self.wv = Linear(d, e)
        self.wr = Linear(d, e)
        self.wh1 = Linear(d, d)
        self.wh2 = Linear(e, d, bias=False)
        self.gamma = nn.Parameter(torch.empty(2, z))  # Q/K scales, applied as (1 + gamma)
        self.beta = nn.Parameter(torch.empty(2, z))  # Q/K offsets
        self.num_heads = h
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.gamma)
        nn.init.zeros_(self.beta)

    def _qkv(
        self, x_hat: Tensor, m: Tensor, rebuild: bool
    ) -> tuple[Tensor, Tensor, Tensor, Callable[[], Tensor]]:
        """(Z [B, L, h, Z/h], V [B, L, h, E/h], W_r M before its SiLU, a function giving X̂ W_v + b).

        With ``rebuild``, X̂ W_v + b is not stored for SiLU's backward: it is rebuilt from X̂ (kept anyway, by
        W_v and CEMA), with one GEMM shared with V's rebuild for attention's backward."""
        b, length, _ = m.shape
        h = self.num_heads
        z = self.wz(m).view(b, length, h, -1)
        v_pre = self.wv(x_hat)
        if not rebuild:
            return z, F.silu(v_pre).view(b, length, h, -1), self.wr(m), lambda: v_pre
        rebuild_pre = rebuild_linear(x_hat, self.wv.weight, self.wv.bias, like=v_pre)
        with recompute_saved(((v_pre,), lambda: (rebuild_pre(),))):
            v = F.silu(v_pre).view(b, length, h, -1)
        return z, v, self.wr(m), rebuild_pre

    def _rope(self, z: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """RoPE(Q), RoPE(K) from Z, in V's dtype (the Linear layers' compute dtype: bf16 under autocast), so
        Q, K and V reach ``chunk_attention`` in one dtype; under autograd only Z is stored."""
        cfg = self.cfg
        return qk_norm_rope(
            z, self.gamma, self.beta, cfg.rope_base, cfg.norm_eps, cfg.chunk_size, start, v.dtype
        )

    def forward(
        self,
        x: Tensor,
        padding_mask: Tensor | None = None,
        cache: LayerCache | None = None,
        pos: int = 0,
    ) -> tuple[Tensor, LayerCache | None]:
        """x: [B, L, D] -> (Y [B, L, D], new cache).

        Without a cache the whole sequence is one pass (training). With a cache, ``x`` is a piece of the
        stream starting at absolute position ``pos`` that never crosses a chunk boundary unless it starts on
        one (the model splits segments accordingly).
        """
        cfg = self.cfg
        c = cfg.chunk_size
        x_hat, norm_state = self.timenorm(x, None if cache is None else cache.norm, padding_mask)
        # The whole-sequence group norm already zeroes padded steps: CEMA's masked copy of x_hat would be
        # x_hat again, stored a second time for backward.
        cema_out, h_last = self.cema(
            x_hat, h0=None if cache is None else cache.cema,
            padding_mask=padding_mask if self.causal else None, return_state=cache is not None,
        )  # fmt: skip
        # M in the Linears' autocast dtype once: W_z, W_r, W_h1 (and W_r's rebuild) share one stored copy
        m = autocast_input(F.dropout(self.rmsnorm(cema_out), cfg.hidden_dropout, self.training))
        length = x.shape[1]
        rebuild = torch.is_grad_enabled() and cfg.rebuilds_linears(length)
        z, v, r_pre, rebuild_pre = self._qkv(x_hat, m, rebuild)
        offset = pos % c
        attn_p = cfg.attention_dropout if self.training else 0.0
        new_cache = None
        if cache is None or offset == 0:
            q, k = self._rope(z, v, 0)
            # Attention keeps no V of its own: V = SiLU(X̂ W_v + b) is rebuilt when backward needs it (the
            # GEMM is shared with SiLU's backward, see _qkv). Q, K are kept: rebuilding them measured slower
            # (their recompute for the Z gradient runs later, so it cannot be shared) and did not lower the peak.
            v_shape = v.shape  # not v itself: the closure would keep it alive
            rebuild_v = lambda: (F.silu(rebuild_pre()).view(v_shape),)  # noqa: E731
            with recompute_saved(((v,), rebuild_v)):
                o = chunk_attention(q, k, v, c, self.causal, padding_mask, attn_p)
            if cache is not None:
                tail = length % c  # keys of the unfinished last chunk stay cached (copied: bounded memory)
                kv = ChunkKV.new(k[:, length - tail :], v[:, length - tail :], c) if tail else None
                new_cache = LayerCache(norm_state, h_last, kv, cache.window)
        else:
            if offset + length > c:
                raise ValueError(f"streaming piece of {length} tokens at chunk offset {offset} crosses C={c}")
            q, k = self._rope(z, v, offset)
            # a chunk left in bf16 by decode steps (kv_dtype, autocast) continues in this segment's dtype
            kv = ChunkKV.new(k, v, c) if cache.kv is None else cache.kv.to(k.dtype).append(k, v)
            o = attention_with_cache(q, kv.keys, kv.values, offset)
            full = offset + length == c
            new_cache = LayerCache(norm_state, h_last, None if full else kv, cache.window)
        o = o.reshape(*o.shape[:2], -1)
        if self.training and cfg.hidden_dropout > 0:
            gated = F.dropout(o * F.silu(r_pre), cfg.hidden_dropout, self.training)
            return self.wh1(m) + self.wh2(gated), new_cache
        if not rebuild:
            return self.wh1(m) + silu_gate_linear(r_pre, o, self.wh2.weight), new_cache
        # M W_r + b is rebuilt from M (kept by W_z, W_r, W_h1) for the gate's backward, not stored
        rebuild_r = rebuild_linear(m, self.wr.weight, self.wr.bias, like=r_pre)
        with recompute_saved(((r_pre,), lambda: (rebuild_r(),))):
            gated = silu_gate_linear(r_pre, o, self.wh2.weight)
        return self.wh1(m) + gated, new_cache
