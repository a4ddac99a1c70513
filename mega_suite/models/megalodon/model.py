"""Megalodon, top to bottom (SPEC §1-§7).

    X̂ = TimestepNorm(X)            X' = CEMA(X̂)                M = RMSNorm(X')
    Q, K = per-head normalised Z = M W_z, scaled (1 + γ) / sqrt(Z/h) + β, RoPE inside each chunk
    V = SiLU(X̂ W_v)  R = SiLU(M W_r)   O = ChunkAttention(Q, K, V)
    H = M W_h1 + (O ⊙ R) W_h2        Y = H + X
    out = X + FFN(LayerNorm(Y))       (two-hop residual: the FFN's residual is X, not Y)

Parameter and buffer names follow the reference release (``layers.{i}.mega.*``, ``layers.{i}.nffn.*``,
``embed``, ``output.final_norm``, ``output.output``), so its state dicts load as they are.
Every module re-initialises itself with ``reset_parameters()``, so models can be built on the meta device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.attention import attention_with_cache, chunk_attention
from kernels.cema import cema, cema_coefficients
from kernels.timestep_norm import group_norm, merge_norm_states, timestep_norm
from mega_suite.models.common import (
    Backbone,
    OutputProjection,
    RMSNorm,
    autocast_input,
    float32_island,
    init_all,
    init_linear,
    rope,
)
from mega_suite.models.megalodon import decode
from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.models.megalodon.lean import (
    dropout,
    rebuild_linear,
    recompute,
    recompute_saved,
    silu_gate_linear,
)

NormState = tuple[Tensor, Tensor, Tensor]


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        init_linear(self)


# --------------------------------------------------------------------------- norms


@float32_island()
class TimestepNorm(nn.Module):
    """Causal group norm with statistics carried across segments (SPEC §3).

    With ``causal=False`` it is the whole-sequence group norm of the classifier (same parameters).
    The buffers ``prior_count, prior_mean, prior_logv`` are the reference release's initial state
    (count 0, mean 0, log-variance 0); a stream starts from them (``initial_state``), a full pass from
    count 0, which is the same thing while the count is 0.
    """

    chunk_parallel = None  # a mega_suite.chunk_parallel.ChunkParallelContext while attached

    def __init__(self, dim: int, num_groups: int, eps: float = 1e-5, causal: bool = True):
        super().__init__()
        self.dim, self.num_groups, self.eps, self.causal = dim, num_groups, eps, causal
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.register_buffer("prior_count", torch.empty((), dtype=torch.int64))
        self.register_buffer("prior_mean", torch.empty(num_groups))
        self.register_buffer("prior_logv", torch.empty(num_groups))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)
        self.prior_count.zero_()
        self.prior_mean.zero_()
        self.prior_logv.zero_()

    def initial_state(self, batch: int) -> NormState:
        dtype = torch.float64 if self.weight.dtype == torch.float64 else torch.float32
        count = self.prior_count.expand(batch).clone()
        mean = self.prior_mean.to(dtype).expand(batch, -1).clone()
        var = self.prior_logv.to(dtype).exp().expand(batch, -1).clone()
        return count, mean, var

    def forward(
        self, x: Tensor, state: NormState | None = None, padding_mask: Tensor | None = None
    ) -> tuple[Tensor, NormState | None]:
        if not self.causal:  # elementwise and two reductions: recomputed in backward, only x is stored
            g, eps = self.num_groups, self.eps
            fn = functools.partial(group_norm, num_groups=g, eps=eps, padding_mask=padding_mask)
            return recompute(fn, x, self.weight, self.bias), None
        if state is None and self.chunk_parallel is not None:  # x is one rank's slice (SPEC §8)
            return self.chunk_parallel.timestep_norm(self, x, padding_mask)
        if state is None and x.device.type == "cpu":  # the reference's cumulative sums: recomputed in
            # backward, only x stored (the CUDA Triton kernel keeps its own small statistics)
            fn = functools.partial(self._flat_norm, padding_mask=padding_mask)
            y, *new_state = recompute(fn, x, self.weight, self.bias)
            return y, tuple(new_state)
        return timestep_norm(x, self.weight, self.bias, self.num_groups, self.eps, state, padding_mask)

    def _flat_norm(self, x: Tensor, weight: Tensor, bias: Tensor, padding_mask: Tensor | None):
        y, state = timestep_norm(x, weight, bias, self.num_groups, self.eps, None, padding_mask)
        return y, *state

    def extra_repr(self) -> str:
        return f"{self.dim}, groups={self.num_groups}, eps={self.eps}, causal={self.causal}"


@float32_island()
class LayerNorm(nn.LayerNorm):
    """LayerNorm with the plus-one affine: (1 + weight), bias; weight initialised to 0."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, 1 + self.weight, self.bias, self.eps)


# --------------------------------------------------------------------------- CEMA


@float32_island()
class ComplexEMA(nn.Module):
    """Complex exponential moving average (SPEC §2); bidirectional for classification (2D rows)."""

    no_weight_decay_params = ("alpha", "delta", "theta", "gamma", "omega")
    chunk_parallel = None  # a mega_suite.chunk_parallel.ChunkParallelContext while attached

    def __init__(self, dim: int, ndim: int = 16, bidirectional: bool = False, method: str = "auto"):
        super().__init__()
        self.dim, self.ndim, self.bidirectional, self.method = dim, ndim, bidirectional, method
        rows = 2 * dim if bidirectional else dim
        self.alpha = nn.Parameter(torch.empty(rows, ndim, 1))
        self.delta = nn.Parameter(torch.empty(rows, ndim, 1))
        self.theta = nn.Parameter(torch.empty(rows, 1, 1))
        self.gamma = nn.Parameter(torch.empty(rows, ndim, 2))
        self.omega = nn.Parameter(torch.empty(dim, 1))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.alpha, 0.0, 0.2)
        nn.init.normal_(self.delta, 0.0, 0.2)
        # theta_d = logit(D^(-pi(d)/D)): base frequencies spread log-uniformly over (1/D, 1).
        rows = self.theta.shape[0]
        for start in range(0, rows, self.dim):
            perm = torch.randperm(self.dim, device="cpu").to(self.theta.device, self.theta.dtype) + 1
            freqs = torch.exp(-perm / self.dim * math.log(self.dim))
            self.theta[start : start + self.dim, 0, 0] = torch.logit(freqs)
        nn.init.normal_(self.gamma[..., 0], 0.0, 1.0)
        nn.init.zeros_(self.gamma[..., 1])
        nn.init.trunc_normal_(self.omega, 0.0, 0.25, -1.0, 1.0)

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        """(p, q, gamma) of SPEC §2; without autograd (decoding) cached until a parameter changes."""
        if torch.is_grad_enabled():
            return cema_coefficients(self.alpha, self.delta, self.theta, self.gamma)
        params = (self.alpha, self.delta, self.theta, self.gamma)
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in params)
        cached = getattr(self, "_coefficient_cache", None)
        if cached is None or cached[0] != key:
            cached = (key, cema_coefficients(*params))
            self._coefficient_cache = cached
        return cached[1]

    def forward(
        self,
        x: Tensor,
        h0: Tensor | None = None,
        padding_mask: Tensor | None = None,
        return_state: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x: [B, L, D] -> (y [B, L, D], h_last [B, D, N] complex or None)."""
        if h0 is None and self.chunk_parallel is not None:  # x is one rank's slice (SPEC §8)
            return self.chunk_parallel.cema(self, x, padding_mask, return_state)
        p, q, gamma = self.coefficients()
        method = "sequential" if (h0 is not None or return_state) and x.shape[1] <= 16 else self.method
        return cema(
            x, p, q, gamma, self.omega.squeeze(-1), h0=h0, bidirectional=self.bidirectional,
            padding_mask=padding_mask, method=method, return_state=return_state,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"{self.dim}, ndim={self.ndim}, bidirectional={self.bidirectional}"


# --------------------------------------------------------------------------- attention layer


@dataclass
class NormWindow:
    """Windowed-statistics mode (SPEC §7): the norm state at the start of the current chunk and the
    statistics of the most recent complete chunks."""

    start: NormState
    chunks: list = field(default_factory=list)


@dataclass
class ChunkKV:
    """Keys and values of the unfinished chunk, in buffers of C rows: appending a token costs O(1).

    Caches may share buffers (one cache continued twice): each reads only its first ``length`` rows, and
    appending where another cache already wrote copies the buffers first (copy on write). Under autograd the
    buffers are never written in place.
    """

    def __init__(self, k: Tensor, v: Tensor, length: int, mark: list[int]):
        self.k_buf, self.v_buf, self.length, self.mark = k, v, length, mark

    @staticmethod
    def new(k: Tensor, v: Tensor, capacity: int) -> ChunkKV:
        n = k.shape[1]
        if torch.is_grad_enabled():
            return ChunkKV(k, v, n, [n])
        kb = k.new_empty(k.shape[0], max(capacity, n), *k.shape[2:])
        vb = v.new_empty(v.shape[0], max(capacity, n), *v.shape[2:])
        kb[:, :n], vb[:, :n] = k, v
        return ChunkKV(kb, vb, n, [n])

    def append(self, k: Tensor, v: Tensor) -> ChunkKV:
        n, l = self.length, k.shape[1]
        if torch.is_grad_enabled():
            return ChunkKV(torch.cat([self.keys, k], 1), torch.cat([self.values, v], 1), n + l, [n + l])
        kb, vb, mark = self.k_buf, self.v_buf, self.mark
        if mark[0] != n or n + l > kb.shape[1]:  # shared beyond our rows, or full: copy first
            return ChunkKV.new(torch.cat([self.keys, k], 1), torch.cat([self.values, v], 1), kb.shape[1])
        kb[:, n : n + l], vb[:, n : n + l] = k, v
        mark[0] = n + l
        return ChunkKV(kb, vb, n + l, mark)

    def to(self, dtype: torch.dtype) -> ChunkKV:
        """These keys and values in ``dtype``: ``self`` if they are, else a copy in new buffers of the same
        capacity (``self`` and caches sharing its buffers unchanged)."""
        if self.k_buf.dtype == dtype:
            return self
        return ChunkKV.new(self.keys.to(dtype), self.values.to(dtype), self.k_buf.shape[1])

    @property
    def keys(self) -> Tensor:
        return self.k_buf[:, : self.length]

    @property
    def values(self) -> Tensor:
        return self.v_buf[:, : self.length]


@dataclass
class LayerCache:
    """Streaming state of one block: TimestepNorm statistics, CEMA state, KV of the unfinished chunk."""

    norm: NormState
    cema: Tensor | None  # [B, D, N] complex; None before the first token (zeros)
    kv: ChunkKV | None = None  # at most C - 1 tokens
    window: NormWindow | None = None  # windowed-statistics mode only

    @property
    def k(self) -> Tensor | None:  # [B, n < C, h, Z/h]
        return None if self.kv is None else self.kv.keys

    @property
    def v(self) -> Tensor | None:  # [B, n < C, h, E/h]
        return None if self.kv is None else self.kv.values


class MegalodonAttention(nn.Module):
    """TimestepNorm -> CEMA -> normalised chunk attention with gated output (SPEC §1, first half)."""

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

    def _qk(self, z: Tensor, gamma: Tensor, beta: Tensor, positions: Tensor, dtype: torch.dtype):
        """Z -> RoPE(Q), RoPE(K) in ``dtype``: per-head normalised Z (float32, or float64), scaled by
        (1 + gamma) / sqrt(Z/h), offset by beta, rotated in float32, then V's dtype (the Linear layers'
        compute dtype: bf16 under autocast), so Q, K and V reach ``chunk_attention`` in one dtype."""
        h, zd = z.shape[-2:]
        zf = z.float() if z.dtype != torch.float64 else z
        z_hat = zf * torch.rsqrt(zf.square().mean(-1, keepdim=True) + self.cfg.norm_eps)
        scale = (1 + gamma.view(2, 1, 1, h, zd)) / math.sqrt(zd)
        qk = z_hat.unsqueeze(0) * scale + beta.view(2, 1, 1, h, zd)
        base = self.cfg.rope_base
        return rope(qk[0], positions, base).to(dtype), rope(qk[1], positions, base).to(dtype)

    def _rope(self, z: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """RoPE(Q), RoPE(K) from Z; under autograd only Z is stored (``lean.recompute``)."""
        return recompute(
            functools.partial(self._qk, positions=positions, dtype=v.dtype), z, self.gamma, self.beta
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
            positions = torch.arange(length, device=x.device) % c
            q, k = self._rope(z, v, positions)
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
            positions = torch.arange(offset, offset + length, device=x.device)
            q, k = self._rope(z, v, positions)
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


class NormalizedFFN(nn.Module):
    """LayerNorm -> SwiGLU (or SiLU) FFN, optional layer scale (SPEC §1, second half)."""

    def __init__(self, cfg: MegalodonConfig, layer_index: int = 0):
        super().__init__()
        d, f = cfg.model_dim, cfg.ffn_hidden_dim
        self.cfg, self.layer_index = cfg, layer_index
        self.norm = LayerNorm(d, eps=cfg.norm_eps)
        self.fc1 = Linear(d, f, bias=False)
        self.fc2 = Linear(f, d, bias=False)
        self.fc3 = Linear(d, f, bias=False) if cfg.swiglu else None
        self.alpha = nn.Parameter(torch.empty(d)) if cfg.layer_scale else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.alpha is not None:
            nn.init.constant_(self.alpha, 0.1 * 0.5**self.layer_index)

    def forward(self, y: Tensor) -> Tensor:
        u = autocast_input(self.norm(y))  # fc1, fc3 (and their rebuilds) share one stored copy
        b = None if self.fc3 is None else self.fc3(u)
        if self.training and self.cfg.hidden_dropout > 0:
            a = F.silu(self.fc1(u))
            a = a if b is None else a * b
            out = self.fc2(F.dropout(a, self.cfg.hidden_dropout, self.training))
        elif not (torch.is_grad_enabled() and self.cfg.rebuilds_linears(y.shape[1])):
            out = silu_gate_linear(self.fc1(u), b, self.fc2.weight)  # SiLU (and the product) recomputed
        else:  # and fc1 u (fc3 u) rebuilt from u, kept by fc1 and fc3: not stored either
            g = self.fc1(u)
            pre = (g,) if b is None else (g, b)
            fc1 = rebuild_linear(u, self.fc1.weight, None, like=g)
            fc3 = None if b is None else rebuild_linear(u, self.fc3.weight, None, like=b)
            with recompute_saved((pre, lambda: (fc1(),) if fc3 is None else (fc1(), fc3()))):
                out = silu_gate_linear(g, b, self.fc2.weight)
        return out * self.alpha if self.alpha is not None else out


def drop_path(x: Tensor, p: float, training: bool) -> Tensor:
    """Stochastic depth: drop the whole residual branch per sample, rescale the kept ones."""
    if p == 0.0 or not training:
        return x
    keep = torch.empty(x.shape[0], *([1] * (x.dim() - 1)), device=x.device, dtype=x.dtype).bernoulli_(1 - p)
    return x * keep / (1 - p)


class MegalodonBlock(nn.Module):
    """One block with the two-hop residual: out = X + FFN(LN(H + X))."""

    def __init__(self, cfg: MegalodonConfig, layer_index: int = 0):
        super().__init__()
        self.cfg = cfg
        self.mega = MegalodonAttention(cfg)
        self.nffn = NormalizedFFN(cfg, layer_index)
        self.drop_path = cfg.drop_path * layer_index / max(1, cfg.num_layers - 1)

    def forward(
        self, x: Tensor, padding_mask: Tensor | None = None, cache: LayerCache | None = None, pos: int = 0
    ) -> tuple[Tensor, LayerCache | None]:
        p = self.cfg.dropout
        h, cache = self.mega(x, padding_mask, cache, pos)
        y = drop_path(dropout(h, p, self.training), self.drop_path, self.training) + x
        out = x + drop_path(dropout(self.nffn(y), p, self.training), self.drop_path, self.training)
        return out, cache

    def step(
        self, x: Tensor, cache: LayerCache, pos: int, pack: decode.BlockPack | None = None
    ) -> tuple[Tensor, LayerCache]:
        """One token, no autograd: x [B, D] float32 at absolute position ``pos`` -> (X + FFN(LN(H + X)), cache),
        through ``decode.block_step`` with this block's packed weights (``MegalodonLM`` passes its plan's;
        without one, float32 weights are packed for this call)."""
        return decode.block_step(pack or decode.BlockPack(self, torch.float32, "matmul"), x, cache, pos)


# --------------------------------------------------------------------------- language model


@dataclass
class StreamingCache:
    """Everything the LM carries between segments (SPEC §7): O(C) memory whatever the context length."""

    position: int  # tokens consumed so far (same for every batch row)
    layers: list[LayerCache]
    final_norm: NormState
    window_stats: bool = False  # replace norm statistics by the last 6 chunks once 8 have been seen
    final_window: NormWindow | None = None

    def memory_bytes(self) -> int:
        tensors = [t for lc in self.layers for t in (*lc.norm, lc.cema) if t is not None]
        tensors += [t for lc in self.layers if lc.kv is not None for t in (lc.kv.k_buf, lc.kv.v_buf)]
        tensors += list(self.final_norm)
        return sum(t.numel() * t.element_size() for t in tensors)


class OutputHead(nn.Module):
    """Final TimestepNorm and the output projection (reference names ``output.final_norm``, ``output.output``)."""

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        self.final_norm = TimestepNorm(cfg.model_dim, cfg.norm_num_groups, cfg.norm_eps)
        self.output = OutputProjection(cfg.model_dim, cfg.vocab_size, bias=False)


WINDOW_CHUNKS, WINDOW_AFTER = 6, 8  # SPEC §7: statistics of the last 6 chunks once 8 have been seen


def _unmerge(total: NormState, prefix: NormState) -> NormState:
    """The statistics of the steps in ``total`` but not in ``prefix`` (inverse of the Welford merge)."""
    nt, mt, vt = (t.double() for t in total)
    np_, mp, vp = (t.double() for t in prefix)
    n = (nt - np_).clamp(min=1).unsqueeze(-1)
    s1 = nt.unsqueeze(-1) * mt - np_.unsqueeze(-1) * mp
    s2 = nt.unsqueeze(-1) * (vt + mt.square()) - np_.unsqueeze(-1) * (vp + mp.square())
    mean = s1 / n
    var = (s2 / n - mean.square()).clamp(min=0)
    return total[0] - prefix[0], mean.to(total[1].dtype), var.to(total[2].dtype)


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
    """Causal language model: embed -> blocks -> final TimestepNorm -> output projection (SPEC §5)."""

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
            # CEMA state None = zeros: the prompt's pass then skips the carried-state terms (no zero work).
            # Not while chunk parallelism is attached: there h0=None means "this rank's slice" (SPEC §8).
            cema_mod, h = layer.mega.cema, None
            if cema_mod.chunk_parallel is not None:
                ctype = torch.complex128 if cema_mod.alpha.dtype == torch.float64 else torch.complex64
                d, n = self.cfg.model_dim, self.cfg.cema_ndim
                h = torch.zeros(batch, d, n, dtype=ctype, device=cema_mod.alpha.device)
            layers.append(LayerCache(norm, h, window=NormWindow(norm) if window_stats else None))
        final = self.output.final_norm.initial_state(batch)
        return StreamingCache(0, layers, final, window_stats, NormWindow(final) if window_stats else None)

    def forward(
        self, tokens: Tensor, cache: StreamingCache | None = None, use_cache: bool = False
    ) -> tuple[Tensor, StreamingCache | None]:
        """tokens [B, L] -> (logits [B, L, V] float32, cache).

        With ``cache`` (or ``use_cache=True``) the call continues a stream: any split of a sequence into
        segments gives the same logits as one full pass. Segments may have any length.
        """
        if tokens.dim() == 2 and tokens.shape[1] == 1 and cache is not None and self._can_step(cache):
            x, cache = self._step_token(tokens[:, 0], cache)
            with torch.autocast(tokens.device.type, enabled=False):  # float32 logits (SPEC §5)
                return self._decode_plan.head(x[:, 0]).unsqueeze(1), cache  # the head's packed weight
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
        if cache is None:
            cache = self.new_cache(tokens.shape[0])
        if tokens.shape[1] == 1 and self._can_step(cache):
            return self._step_token(tokens[:, 0], cache)
        decode.parameters_may_have_changed()  # every decode plan re-lists the parameter objects once
        outs = []
        for piece in self._pieces(tokens.shape[1], cache):
            out, cache = self._stream_piece(tokens[:, piece], cache)
            outs.append(out)
        if not outs:
            dtype = self.output.final_norm.weight.dtype
            return tokens.new_zeros(tokens.shape[0], 0, self.cfg.model_dim, dtype=dtype), cache
        return torch.cat(outs, 1), cache

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
            self._window_statistics(new)
        return x, new

    def _can_step(self, cache: StreamingCache) -> bool:
        """The one-token path: no autograd, float32 (float64 models keep the reference path), token embeds."""
        from torch.distributed.fsdp import FSDPModule

        ref = self.output.final_norm.weight
        sharded = isinstance(self.layers[0], FSDPModule)  # block.step bypasses FSDP2's gather hooks
        return (
            not torch.is_grad_enabled() and ref.dtype == torch.float32 and not self.adaptive and not sharded
        )

    def _step_token(self, tokens: Tensor, cache: StreamingCache) -> tuple[Tensor, StreamingCache]:
        """tokens [B] at position ``cache.position`` -> (final hidden states [B, 1, D], cache). Autocast is
        off inside: the plan's weight dtype decides the GEMVs' precision, everything else is float32."""
        with torch.autocast(tokens.device.type, enabled=False):
            return self._step_token_fp32(tokens, cache)

    def _step_token_fp32(self, tokens: Tensor, cache: StreamingCache) -> tuple[Tensor, StreamingCache]:
        plan = self.decode_plan()
        pos = cache.position
        x = self.embed_tokens(tokens)
        new_layers = []
        for layer, pack, lc in zip(self.layers, plan.blocks, cache.layers):
            x, lc = layer.step(x, lc, pos, pack)
            new_layers.append(lc)
        x, final_state = decode.timestep_norm_step(
            x, cache.final_norm, plan.final_w1, plan.final_b, plan.final_groups, plan.final_eps
        )
        new = StreamingCache(pos + 1, new_layers, final_state, cache.window_stats, cache.final_window)
        if cache.window_stats and (pos + 1) % self.cfg.chunk_size == 0:
            self._window_statistics(new)
        return x.unsqueeze(1), new

    _decode_options = (torch.float32, "matmul", None)
    _decode_plan = None

    @torch.no_grad()
    def to_decode_dtype(
        self, dtype: torch.dtype | None, gemv: str = "matmul", kv_dtype: torch.dtype | None = None
    ) -> MegalodonLM:
        """Weights of the one-token path: ``dtype`` float32 (or ``None``), torch.bfloat16, or torch.int8
        (weight-only, per-row scales); ``gemv`` "matmul" (BLAS), "rows" (``torch.mv`` over W [O, I]: what
        the compiled CPU ``StaticDecoder`` reads where "matmul" is set here; slower eager) or "mkldnn"
        (oneDNN with reordered weights, CPU).
        The path reads packed copies of the weights (``decode.DecodePlan``), never the parameters; they are
        rebuilt whenever a parameter changes. ``kv_dtype``: the dtype the unfinished chunk's keys and values
        are kept in while decoding, torch.bfloat16 (half the memory; at 1536 tokens into a chunk of
        ``megalodon_cpu_bench`` they are 28 MB in float32, as much as its bf16 weights, and the compiled
        ``StaticDecoder`` reads them as bf16; the eager step casts them to float32 for its products) or
        float32; None keeps the dtype they were computed in (float32, or bf16 from a prompt run under
        autocast). A prompt's cache in another dtype is converted at the first step. Activations, CEMA,
        every norm's statistics and the logits stay float32; the attention's precision with bf16 keys is
        ``decode.attend``'s."""
        dtype = torch.float32 if dtype is None else dtype
        decode.check_decode_options(dtype, gemv, self.output.final_norm.weight.device, kv_dtype)
        self._decode_options = (dtype, gemv, kv_dtype)
        self._decode_plan = None
        return self

    @torch.no_grad()
    def decode_plan(self, kind: str | None = None) -> decode.DecodePlan:
        """The packed decode weights, rebuilt if any parameter changed since they were packed (training,
        ``load_state_dict``, ``to``; see ``decode.DecodePlan.is_current``). ``kind``: a GEMV kind to pack
        for other than ``to_decode_dtype``'s (the compiled CPU ``StaticDecoder`` asks for "rows"); the
        model keeps the plan last asked for."""
        dtype, gemv, kv_dtype = self._decode_options
        options = (dtype, gemv if kind is None else kind, kv_dtype)
        plan = self._decode_plan
        if plan is None or not plan.is_current(self, *options):
            plan = self._decode_plan = decode.DecodePlan(self, *options)
        return plan

    def _window_statistics(self, cache: StreamingCache) -> None:
        """At a chunk boundary: record this chunk's statistics; once 8 chunks have been seen, every norm
        (the blocks' and the final one) continues from the statistics of the last 6 chunks only."""
        chunks_seen = cache.position // self.cfg.chunk_size

        def advance(state: NormState, window: NormWindow) -> tuple[NormState, NormWindow]:
            chunks = (window.chunks + [_unmerge(state, window.start)])[-WINDOW_CHUNKS:]
            if chunks_seen >= WINDOW_AFTER:
                state = chunks[0]
                for s in chunks[1:]:
                    state = merge_norm_states(state, s)
            return state, NormWindow(state, chunks)

        for lc in cache.layers:
            lc.norm, lc.window = advance(lc.norm, lc.window)
        cache.final_norm, cache.final_window = advance(cache.final_norm, cache.final_window)

    @torch.no_grad()
    def generate(
        self,
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
    ) -> Tensor:
        """Continue ``prompt`` [B, L] by up to ``max_new_tokens`` tokens with the streaming cache.

        Memory is bounded by the chunk size, not the context length. Returns [B, L + new]. ``static``:
        decode through ``decode.StaticDecoder`` (fixed buffers; a CUDA graph per step on a GPU);
        ``compile``: the same, its step compiled by torch.compile first (the fastest CPU path, 10-15 s
        of compile; bench/RESULTS.md §16). Both need a float32, unsharded, non-adaptive model.
        """
        from mega_suite.generation import sample_next

        if prompt.dim() != 2 or prompt.shape[1] == 0:
            raise ValueError(f"prompt must be a non-empty [B, L] tensor, got shape {tuple(prompt.shape)}")
        if (static or compile) and window_stats:
            raise ValueError("static / compiled decoding does not support window_stats")
        cache = self.new_cache(prompt.shape[0], window_stats)
        logits, cache = self(prompt, cache)
        if static or compile:
            dec = decode.StaticDecoder(self, cache, compile=compile)

            def advance(tokens: Tensor) -> Tensor:
                return dec.step(tokens).unsqueeze(1)
        else:

            def advance(tokens: Tensor) -> Tensor:
                nonlocal cache
                logits, cache = self(tokens[:, None], cache)
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
            logits = advance(nxt)
        return torch.cat(out, 1)


# --------------------------------------------------------------------------- classification


class TokenEncoder(nn.Module):
    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.model_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.model_dim**-0.5
        nn.init.trunc_normal_(self.embed.weight, 0.0, std, -3 * std, 3 * std)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 2:
            raise ValueError(f"token input must be [B, L] int64, got shape {tuple(x.shape)}")
        out = self.embed(x)
        return out * math.sqrt(self.cfg.model_dim) if self.cfg.scale_emb else out


class ScalarEncoder(nn.Module):
    """Pixel or audio sample x -> x * w + b (a vector per step)."""

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.model_dim))
        self.bias = nn.Parameter(torch.empty(cfg.model_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, 1.0)
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 2:
            raise ValueError(f"scalar input must be [B, L] float, got shape {tuple(x.shape)}")
        return x.unsqueeze(-1).to(self.weight.dtype) * self.weight + self.bias


class PatchEncoder(nn.Module):
    """16x16 patch embedding plus learned positions (ImageNet): [B, C, H, W] -> [B, H*W/P^2, D]."""

    no_weight_decay_params = ("pos",)

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        self.cfg = cfg
        self.proj = nn.Conv2d(cfg.in_chans, cfg.model_dim, cfg.patch_size, stride=cfg.patch_size)
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.pos = nn.Parameter(torch.empty(1, self.num_patches, cfg.model_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.proj.reset_parameters()
        nn.init.trunc_normal_(self.pos, 0.0, 0.02)

    def forward(self, x: Tensor) -> Tensor:
        side = self.cfg.image_size
        if x.dim() != 4 or x.shape[1] != self.cfg.in_chans or x.shape[-2:] != (side, side):
            raise ValueError(
                f"image input must be [B, {self.cfg.in_chans}, {side}, {side}], got shape {tuple(x.shape)}"
            )
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


ENCODERS = {"token": TokenEncoder, "scalar": ScalarEncoder, "patch": PatchEncoder}


@float32_island()
class ClassificationHead(nn.Module):
    """Masked mean over valid steps -> Linear(D, 2D) -> GELU -> dropout -> Linear(2D, classes)."""

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        width = cfg.model_dim * (2 if cfg.dual_input else 1)
        self.dropout = cfg.dropout
        self.fc1 = Linear(width, 2 * cfg.model_dim)
        self.fc2 = Linear(2 * cfg.model_dim, cfg.num_classes, bias=False)

    def forward(self, pooled: Tensor) -> Tensor:
        h = F.dropout(F.gelu(self.fc1(pooled)), self.dropout, self.training)
        out = self.fc2(h)
        return out if out.dtype == torch.float64 else out.float()


class MegalodonClassifier(Backbone):
    """Encoder -> bidirectional blocks with group norm -> final group norm -> pooled head (SPEC §6)."""

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        if not cfg.is_classifier:
            raise ValueError("MegalodonClassifier needs num_classes > 0")
        self.cfg = cfg
        self.encoder = ENCODERS[cfg.input_type](cfg)
        self.layers = nn.ModuleList(MegalodonBlock(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = TimestepNorm(cfg.model_dim, cfg.norm_num_groups, cfg.norm_eps, causal=False)
        self.head = ClassificationHead(cfg)
        self.gradient_checkpointing = False

    def init_weights(self) -> None:
        """Re-initialise every parameter and buffer (after ``to_empty`` from the meta device)."""
        init_all(self)

    def encode(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """Inputs -> pooled features [B, D] (masked mean over valid steps)."""
        h = self.encoder(x)
        if padding_mask is not None:
            if padding_mask.shape != h.shape[:2]:
                raise ValueError(
                    f"padding_mask must be {tuple(h.shape[:2])}, got {tuple(padding_mask.shape)}"
                )
            h = h.masked_fill(padding_mask.unsqueeze(-1), 0.0)
        h = dropout(h, self.cfg.dropout, self.training)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                h = torch.utils.checkpoint.checkpoint(
                    lambda t, m=layer: m(t, padding_mask)[0], h, use_reentrant=False
                )
            else:
                h, _ = layer(h, padding_mask)
        h, _ = self.final_norm(h, padding_mask=padding_mask)
        if padding_mask is None:
            return h.mean(1)
        valid = (~padding_mask).unsqueeze(-1).to(h.dtype)
        return (h * valid).sum(1) / valid.sum(1).clamp(min=1)

    def forward(
        self,
        x: Tensor,
        padding_mask: Tensor | None = None,
        x2: Tensor | None = None,
        padding_mask2: Tensor | None = None,
    ) -> Tensor:
        """[B, L] tokens / [B, L] scalars / [B, C, H, W] images -> logits [B, classes] (float32).

        Retrieval (``dual_input``): both documents share weights; the head sees [u, v].
        """
        u = self.encode(x, padding_mask)
        if self.cfg.dual_input:
            if x2 is None:
                raise ValueError("a dual_input (retrieval) classifier needs the second document x2")
            u = torch.cat([u, self.encode(x2, padding_mask2)], dim=-1)
        return self.head(u)


def build_model(cfg: MegalodonConfig) -> nn.Module:
    return MegalodonClassifier(cfg) if cfg.is_classifier else MegalodonLM(cfg)
