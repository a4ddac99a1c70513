"""transformers model of a mega-suite bundle: Megalodon or the suite's Llama baseline, in plain PyTorch, with a
cache that ``generate`` and ``pipeline("text-generation")`` decode through one token per step.

This file stands alone on purpose. A remote-code model on the Hub is one file set that must load where only
torch, transformers and safetensors are installed (as fla's and Mamba's Hub models do), so it restates the
suite's math (docs/architecture.md) instead of importing mega_suite or its Triton kernels.
tests/models/test_hf_bundle.py holds it to the suite model: logits, every cached one-token step and greedy
tokens, in a process where importing mega_suite, kernels and datamodules fails. A change to the suite's math
must be made here too.

Megalodon: TimestepNorm, CEMA (the convolution form by FFT, with carried state; the one-token recurrence), the
normalised chunk attention with RoPE restarting in every chunk, the gated output, the two-hop residual with
the normalised FFN, the final TimestepNorm and float32 logits. ``MegalodonCache`` holds per block the norm
statistics, the CEMA state and the keys / values of the unfinished chunk: O(C) memory at any length.

Llama: pre-norm blocks, RoPE on interleaved pairs, causal attention inside ``max_seq_len``. Beyond it the
window slides as the suite's decoder does (``mega_suite.models.llama.decode``): position t sees the tokens from
``max(0, (t // s) * s - (max_seq_len - s))`` on, s = the evaluation stride, and the window is re-encoded
every s tokens. ``LlamaCache`` holds the window's token ids and keys / values.

Norm statistics, CEMA and the logits are computed in float32 whatever the weights' dtype (the suite's float32
islands); the Linear layers run in the weights' dtype. Rows of a batch must have the same length (no padding).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_mega_suite import MegaSuiteConfig

# transformers 5 renamed the cache argument and output field from past_key_values to cache
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


# --------------------------------------------------------------------------- shared pieces


def _linear(x: Tensor, layer: nn.Linear) -> Tensor:
    """A Linear layer in its weights' dtype, returning float32 (the residual stream's dtype)."""
    return F.linear(x.to(layer.weight.dtype), layer.weight, layer.bias).float()


def _rms(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def _rope_table(d: int, base: float, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin [length, d/2] of RoPE on interleaved pairs, in float32 as the suite computes them."""
    inv = base ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    angle = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(-1) * inv
    return angle.cos(), angle.sin()


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [..., L, h, d] by cos, sin [L, d/2]."""
    x0, x1 = x.unflatten(-1, (x.shape[-1] // 2, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


class _Gemv:
    """y = x Wᵀ + b (+ add) for the one-token steps, with W stored as the CPU's BLAS reads it fastest (Wᵀ [I, O]
    for I <= O, else W [O, I], as the suite's decoder keeps them)."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        self.bias = bias
        o, i = weight.shape
        self.wt = weight.t().contiguous() if i <= o else weight.contiguous().t()

    def __call__(self, x: Tensor, add: Tensor | None = None) -> Tensor:
        bias = self.bias if add is None else (add if self.bias is None else add + self.bias)
        return x @ self.wt if bias is None else torch.addmm(bias, x, self.wt)


def _params_key(module: nn.Module) -> tuple:
    """Changes when any parameter is updated in place or replaced: packed weights built from them are stale."""
    return tuple((p.data_ptr(), p._version, p.dtype) for p in module.parameters())


def _attend_one(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """softmax(q kᵀ · scale) v for one query per row and head: q [B, h, 1, d], keys / values [B, h, n, *]."""
    scores = torch.matmul(q, keys.transpose(-1, -2))
    if scale != 1.0:
        scores = scores * scale
    return torch.matmul(torch.softmax(scores, -1), values)


def _attend_after(q: Tensor, keys: Tensor, values: Tensor, start: int, scale: float | None) -> Tensor:
    """New queries at positions start.. over [cached ; new] keys, causal: q [B, h, l, d], keys [B, h, start + l, d]."""
    length = q.shape[2]
    mask = None
    if length > 1:
        qi = torch.arange(length, device=q.device).view(length, 1) + start
        mask = torch.arange(keys.shape[2], device=q.device).view(1, -1) <= qi
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def _room(buf: Tensor | None, like: Tensor, rows: int, cap: int) -> Tensor:
    """``buf`` [B, h, n, d] grown to hold ``rows`` rows (a power of two, at most ``cap``); a zero buffer shaped
    like ``like`` [B, h, *, d] when None. Caches grow as the stream does, never past ``cap``."""
    if buf is not None and buf.shape[2] >= rows:
        return buf
    size = min(cap, max(64, 1 << max(0, rows - 1).bit_length()))
    new = like.new_zeros(like.shape[0], like.shape[1], size, like.shape[3])
    if buf is not None:
        new[:, :, : buf.shape[2]] = buf
    return new


class _StateCache(Cache):
    """Base of the two caches: a model-specific state object, not transformers' per-layer key / value lists.
    Generation reads ``get_seq_length``; beam search calls ``reorder_cache``."""

    is_compileable = False
    is_croppable = False

    def __init__(self, num_layers: int):
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.position = 0  # tokens consumed (the same for every row)

    def __len__(self) -> int:
        return self.num_layers

    def __bool__(self) -> bool:
        return True

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.position

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.position + query_length, 0

    def _map_rows(self, fn) -> None:
        """Replace every tensor of the state by ``fn`` of it (their first dimension is the batch)."""
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._map_rows(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError(
                f"{type(self).__name__} cannot drop tokens: its state is not a list of them"
            )

    def reset(self) -> None:
        raise NotImplementedError(f"start a new {type(self).__name__} instead (model.new_cache)")


# --------------------------------------------------------------------------- Megalodon


class TimestepNorm(nn.Module):
    """Causal group norm whose statistics run over every step so far (docs/architecture.md#timestepnorm)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("prior_count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("prior_mean", torch.zeros(groups))
        self.register_buffer("prior_logv", torch.zeros(groups))

    def initial_state(self, batch: int) -> tuple[Tensor, Tensor, Tensor]:
        count = self.prior_count.expand(batch).clone()
        mean = self.prior_mean.float().expand(batch, -1).clone()
        return count, mean, self.prior_logv.float().exp().expand(batch, -1).clone()

    def forward(self, x: Tensor, state) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        """x [B, L, D] float32 after ``state`` (count [B], mean [B, G], var [B, G]) -> (y, state after x).

        Running sums of the per-step group statistics in float64, each group shifted by its prior mean (or
        the segment's mean before any step) so that the variance does not cancel."""
        b, length, d = x.shape
        g = self.groups
        count0, mean0, var0 = state
        xg = x.reshape(b, length, g, d // g)
        acc = torch.float64
        with torch.no_grad():
            seg_mean = xg.mean(-1).to(acc).sum(1) / max(length, 1)
            shift = torch.where((count0 > 0).unsqueeze(-1), mean0.to(acc), seg_mean).float()
        xs = xg - shift[:, None, :, None]
        n0 = count0.to(acc).unsqueeze(-1)
        d0 = mean0.to(acc) - shift.to(acc)
        s1 = torch.cumsum(xs.mean(-1).to(acc), 1) + (n0 * d0).unsqueeze(1)
        s2 = torch.cumsum(xs.square().mean(-1).to(acc), 1) + (n0 * (var0.to(acc) + d0.square())).unsqueeze(1)
        n = n0.unsqueeze(1) + torch.arange(1, length + 1, device=x.device, dtype=acc).view(1, length, 1)
        mean = s1 / n
        var = (s2 / n - mean.square()).clamp(min=0)
        y = (xs - mean.float().unsqueeze(-1)) * torch.rsqrt(var + self.eps).float().unsqueeze(-1)
        y = y.reshape(b, length, d) * (1 + self.weight.float()) + self.bias.float()
        if length == 0:
            return y, state
        last = (count0 + length, (mean[:, -1] + shift.to(acc)).float(), var[:, -1].float())
        return y, last


def _timestep_norm_step(x: Tensor, state, w1: Tensor, b: Tensor, groups: int, eps: float):
    """One step of TimestepNorm: the Welford update, statistics in float64. x [B, D]; ``w1`` = 1 + weight."""
    count0, mean0, var0 = state
    bsz, d = x.shape
    xd = x.view(bsz, groups, d // groups).double()
    var_t, mu_t = torch.var_mean(xd, dim=-1, unbiased=False, keepdim=True)
    count = count0 + 1
    inv_n = count.double().reciprocal().view(bsz, 1, 1)
    delta = mu_t - mean0.unsqueeze(-1)
    step = delta * inv_n
    mean = mean0.unsqueeze(-1) + step
    var0 = var0.unsqueeze(-1)
    var = torch.addcmul(torch.addcmul(var0, var_t - var0, inv_n), step, delta - step)
    y = ((xd - mean) * torch.rsqrt(var + eps)).view(bsz, d).float()
    return torch.addcmul(b, y, w1), (count, mean.view(bsz, groups).float(), var.view(bsz, groups).float())


class ComplexEMA(nn.Module):
    """The complex EMA (docs/architecture.md#cema): h_t = p x_t + q h_{t-1}, y_t = Re(Σ_n γ_n h_t) + ω x_t."""

    def __init__(self, dim: int, ndim: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim, ndim, 1))
        self.delta = nn.Parameter(torch.zeros(dim, ndim, 1))
        self.theta = nn.Parameter(torch.zeros(dim, 1, 1))
        self.gamma = nn.Parameter(torch.zeros(dim, ndim, 2))
        self.omega = nn.Parameter(torch.zeros(dim, 1))

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        """p [D, N] real, q [D, N] complex (|q| < 1), γ [D, N] complex, in float32."""
        d, n, _ = self.alpha.shape
        p = torch.sigmoid(self.alpha.float()).squeeze(-1)
        magnitude = 1.0 - p * torch.sigmoid(self.delta.float()).squeeze(-1)
        base = torch.sigmoid(self.theta.float()).reshape(d, 1) * (2 * math.pi / n)
        phase = base * torch.arange(1, n + 1, dtype=torch.float32, device=p.device)
        q = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        g = self.gamma.float() / math.sqrt(n)
        return p, q, torch.complex(g[..., 0], g[..., 1])

    def forward(self, x: Tensor, h0: Tensor | None) -> tuple[Tensor, Tensor]:
        """x [B, L, D] float32, h0 [B, D, N] complex or None (zeros) -> (y [B, L, D], h_{L-1} [B, D, N]).

        The convolution form: y = k * x + Re(Σ_n γ q^(t+1) h0) + ω x with k_l = Re(Σ_n γ p q^l), by FFT;
        the state after the last step h = Σ_s p q^(L-1-s) x_s + q^L h0."""
        p, q, gamma = self.coefficients()
        re, im = q.real.double(), q.imag.double()
        log_q = torch.complex(0.5 * torch.log(re * re + im * im), torch.atan2(im, re))  # q^l = exp(l log q)
        xt = x.transpose(1, 2)  # [B, D, L]
        length = xt.shape[-1]
        k = _vandermonde((gamma * p).unsqueeze(0), log_q, length)[0]  # [D, L]
        n_fft = (
            1 << max(0, 2 * length - 2).bit_length()
        )  # >= 2L - 1: the circular convolution is the linear one
        y = torch.fft.irfft(torch.fft.rfft(xt, n=n_fft) * torch.fft.rfft(k, n=n_fft), n=n_fft)[..., :length]
        if h0 is not None:
            y = y + _vandermonde(gamma * q * h0, log_q, length)
        h = _final_state(xt, p, log_q, h0)
        return y.transpose(1, 2) + self.omega.float().squeeze(-1) * x, h


def _powers(log_q: Tensor, steps: Tensor) -> Tensor:
    """exp(steps · log q) as complex64 (log_q complex128 and steps broadcast): the phase is reduced modulo 2π
    in float64, then cos, sin and exp run in float32."""
    angle = log_q.imag * steps
    phase = (angle - (2 * math.pi) * torch.floor(angle * (0.5 / math.pi))).float()
    magnitude = torch.exp(log_q.real * steps).float()
    return torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))


def _vandermonde(c: Tensor, log_q: Tensor, length: int) -> Tensor:
    """out[m, d, l] = Re(Σ_n c[m, d, n] q[d, n]^l) for l < length, c [M, D, N] complex -> [M, D, length].

    Blockwise, l = a·T + b with T ≈ sqrt(length): a product of the tables q^(aT) [A, N] and q^b [N, T] per
    channel, never a [D, N, length] table."""
    m, d, n = c.shape
    t = max(1, math.ceil(math.sqrt(length)))
    a = math.ceil(length / t)
    steps = lambda count, scale: torch.arange(count, device=c.device, dtype=torch.float64) * scale  # noqa: E731
    q_at = _powers(log_q.unsqueeze(1), steps(a, t).view(1, a, 1))  # [D, A, N]
    q_b = _powers(log_q.unsqueeze(-1), steps(t, 1).view(1, 1, t))  # [D, N, T]
    left = (c.permute(1, 0, 2).unsqueeze(2) * q_at.unsqueeze(1)).reshape(d, m * a, n)
    # Re(L R) = Re L Re R - Im L Im R: one real product of width 2N
    out = torch.bmm(torch.cat([left.real, -left.imag], -1), torch.cat([q_b.real, q_b.imag], 1))
    return out.reshape(d, m, a * t)[..., :length].permute(1, 0, 2)


def _final_state(x: Tensor, p: Tensor, log_q: Tensor, h0: Tensor | None) -> Tensor:
    """h_{L-1} = Σ_s p q^(L-1-s) x_s + q^L h0 for x [B, D, L] -> [B, D, N] complex64, blockwise as above over
    the reversed time r = L-1-s = a·T + j."""
    b, d, length = x.shape
    n = log_q.shape[-1]
    t = max(1, math.ceil(math.sqrt(length)))
    a = math.ceil(length / t)
    rev = F.pad(x.flip(-1), (0, a * t - length)).reshape(b, d, a, t).permute(1, 0, 2, 3).reshape(d, b * a, t)
    steps = torch.arange(max(a, t), device=x.device, dtype=torch.float64)
    q_j = _powers(log_q.unsqueeze(1), steps[:t].view(1, t, 1))  # [D, T, N]
    inner = torch.bmm(rev, torch.cat([q_j.real, q_j.imag], -1))  # Σ_j x q^j, [D, B·A, 2N]
    inner = torch.complex(inner[..., :n], inner[..., n:]).view(d, b, a, n)
    q_at = _powers(log_q.unsqueeze(1), (steps[:a] * t).view(1, a, 1))  # [D, A, N]
    h = ((inner * q_at.unsqueeze(1)).sum(2) * p.unsqueeze(1)).transpose(0, 1)  # [B, D, N]
    if h0 is not None:
        h = h + _powers(log_q, torch.tensor(float(length), dtype=torch.float64, device=x.device)) * h0
    return h


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · (1 + w) (plus_one, Megalodon's) or · w (Llama's), statistics in float32."""

    def __init__(self, dim: int, eps: float, plus_one: bool):
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        y = _rms(x.float(), self.eps)
        return y * (1 + self.weight.float()) if self.plus_one else y * self.weight.float()


class MegalodonAttention(nn.Module):
    """TimestepNorm -> CEMA -> normalised chunk attention with gated output (the first half of a block)."""

    def __init__(self, cfg: dict):
        super().__init__()
        d, z, e = cfg["model_dim"], cfg["z_dim"], cfg["value_dim"]
        self.timenorm = TimestepNorm(d, cfg["norm_num_groups"], cfg["norm_eps"])
        self.cema = ComplexEMA(d, cfg["cema_ndim"])
        self.rmsnorm = RMSNorm(d, cfg["norm_eps"], plus_one=True)
        self.wz, self.wv, self.wr, self.wh1 = (nn.Linear(d, w) for w in (z, e, e, d))
        self.wh2 = nn.Linear(e, d, bias=False)
        self.gamma = nn.Parameter(torch.zeros(2, z))  # Q/K scales, applied as (1 + gamma)
        self.beta = nn.Parameter(torch.zeros(2, z))  # Q/K offsets


class NormalizedFFN(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, f = cfg["model_dim"], cfg["ffn_hidden_dim"]
        self.norm = nn.LayerNorm(d, eps=cfg["norm_eps"])
        self.fc1 = nn.Linear(d, f, bias=False)
        self.fc2 = nn.Linear(f, d, bias=False)
        self.fc3 = nn.Linear(d, f, bias=False) if cfg["swiglu"] else None
        self.alpha = nn.Parameter(torch.zeros(d)) if cfg["layer_scale"] else None

    def forward(self, y: Tensor) -> Tensor:
        u = F.layer_norm(y, y.shape[-1:], 1 + self.norm.weight.float(), self.norm.bias.float(), self.norm.eps)
        a = F.silu(_linear(u, self.fc1))
        if self.fc3 is not None:
            a = a * _linear(u, self.fc3)
        out = _linear(a, self.fc2)
        return out * self.alpha.float() if self.alpha is not None else out


class MegalodonBlock(nn.Module):
    """out = X + FFN(LN(H + X)), H the attention layer's output (the two-hop residual)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.mega = MegalodonAttention(cfg)
        self.nffn = NormalizedFFN(cfg)


class _MegalodonLayerState:
    """One block's streaming state: norm statistics, CEMA state, keys / values of the unfinished chunk."""

    def __init__(self, norm):
        self.norm = norm  # (count [B] int64, mean [B, G], var [B, G])
        self.cema: Tensor | None = None  # [B, D, N] complex64; None before the first token
        self.keys: Tensor | None = None  # [B, h, C, Z/h]: rows < position % C are the current chunk's
        self.values: Tensor | None = None  # [B, h, C, E/h]


class MegalodonCache(_StateCache):
    """Megalodon's streaming state (the suite's ``StreamingCache``) as a transformers ``Cache``."""

    def __init__(self, model: MegalodonLM, batch: int):
        super().__init__(len(model.layers))
        self.layers_state = [_MegalodonLayerState(b.mega.timenorm.initial_state(batch)) for b in model.layers]
        self.final_norm = model.output.final_norm.initial_state(batch)
        self.pack = None  # the packed one-token weights, set by the model

    def _map_rows(self, fn) -> None:
        for s in self.layers_state:
            s.norm = tuple(fn(t) for t in s.norm)
            s.cema, s.keys, s.values = (None if t is None else fn(t) for t in (s.cema, s.keys, s.values))
        self.final_norm = tuple(fn(t) for t in self.final_norm)

    @property
    def batch_size(self) -> int:
        return self.final_norm[0].shape[0]


class _MegalodonBlockPack:
    """A block's weights for the one-token step: [W_z | W_r | W_h1] with RMSNorm's (1 + w) folded in, the
    LayerNorm affine folded into [W_1 | W_3], the layer scale into W_2, the CEMA coefficients, the Q/K scale."""

    def __init__(self, block: MegalodonBlock, cfg: dict):
        att, ffn = block.mega, block.nffn
        f = lambda t: t.detach().float()  # noqa: E731
        d, z, e, h = cfg["model_dim"], cfg["z_dim"], cfg["value_dim"], cfg["num_heads"]
        self.d, self.z, self.e, self.h, self.zd = d, z, e, h, z // h
        self.groups, self.eps = cfg["norm_num_groups"], cfg["norm_eps"]
        self.tn_w1, self.tn_b = 1 + f(att.timenorm.weight), f(att.timenorm.bias)
        with torch.no_grad():
            p, q, gamma = att.cema.coefficients()
        self.p, self.q, self.gamma_conj = p, q, gamma.conj().resolve_conj()  # vecdot conjugates its first
        self.omega = f(att.cema.omega).squeeze(-1)
        rms = 1 + f(att.rmsnorm.weight)
        w_m = torch.cat([f(att.wz.weight), f(att.wr.weight), f(att.wh1.weight)]) * rms
        self.gemv_m = _Gemv(w_m, torch.cat([f(att.wz.bias), f(att.wr.bias), f(att.wh1.bias)]))
        self.gemv_v = _Gemv(f(att.wv.weight), f(att.wv.bias))
        self.gemv_h2 = _Gemv(f(att.wh2.weight), None)
        self.qk_scale = ((1 + f(att.gamma)) / math.sqrt(self.zd)).view(2, 1, h, self.zd)
        self.qk_beta = f(att.beta).view(2, 1, h, self.zd)
        self.ln_eps = ffn.norm.eps
        w13 = f(ffn.fc1.weight) if ffn.fc3 is None else torch.cat([f(ffn.fc1.weight), f(ffn.fc3.weight)])
        self.swiglu, self.ffn_dim = ffn.fc3 is not None, ffn.fc1.out_features
        self.gemv_13 = _Gemv(w13 * (1 + f(ffn.norm.weight)), w13 @ f(ffn.norm.bias))
        w2 = f(ffn.fc2.weight)
        self.gemv_2 = _Gemv(w2 * f(ffn.alpha)[:, None] if ffn.alpha is not None else w2, None)


class _MegalodonPack:
    def __init__(self, model: MegalodonLM):
        self.key = _params_key(model)
        self.blocks = [_MegalodonBlockPack(b, model.cfg) for b in model.layers]
        fn = model.output.final_norm
        self.final_w1, self.final_b = 1 + fn.weight.detach().float(), fn.bias.detach().float()
        self.head = _Gemv(model.output.output.weight.detach().float(), None)


class MegalodonOutput(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.final_norm = TimestepNorm(cfg["model_dim"], cfg["norm_num_groups"], cfg["norm_eps"])
        self.output = nn.Linear(cfg["model_dim"], cfg["vocab_size"], bias=False)


class MegalodonLM(nn.Module):
    """embed -> Megalodon blocks -> final TimestepNorm -> output projection (parameter names as the suite's)."""

    def __init__(self, cfg: dict):
        super().__init__()
        if cfg.get("adaptive_cutoffs") or cfg.get("num_classes", 0):
            raise ValueError(
                "this bundle's Megalodon has an adaptive softmax or is a classifier: not supported here"
            )
        self.cfg = cfg
        self.embed = nn.Embedding(cfg["vocab_size"], cfg["model_dim"])
        self.layers = nn.ModuleList(MegalodonBlock(cfg) for _ in range(cfg["num_layers"]))
        self.output = MegalodonOutput(cfg)
        if cfg["share_emb"]:
            self.output.output.weight = self.embed.weight
        self._pack: _MegalodonPack | None = None
        self._rope: dict = {}

    def output_projection(self) -> nn.Linear:
        return self.output.output

    def new_cache(self, batch: int) -> MegalodonCache:
        cache = MegalodonCache(self, batch)
        if not torch.is_grad_enabled():
            if self._pack is None or self._pack.key != _params_key(self):
                self._pack = _MegalodonPack(self)
            cache.pack = self._pack
        return cache

    def rope(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._rope:
            cfg = self.cfg
            zd = cfg["z_dim"] // cfg["num_heads"]
            self._rope[device] = _rope_table(zd, cfg["rope_base"], cfg["chunk_size"], device)
        return self._rope[device]

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens).float()
        return x * math.sqrt(self.cfg["model_dim"]) if self.cfg["scale_emb"] else x

    def logits(self, x: Tensor) -> Tensor:
        w = self.output.output.weight
        return F.linear(x, w.float())  # float32 logits, whatever the weights' dtype

    def forward(self, tokens: Tensor, cache: MegalodonCache | None) -> Tensor:
        """tokens [B, L] -> final normalised hidden states [B, L, D]; with ``cache`` the stream continues
        from it (any split of a sequence gives the full pass's results) and the cache is updated in place."""
        if cache is None:
            x = self.embed_tokens(tokens)
            for block in self.layers:
                x, _ = self._block(block, x, None, 0)
            return self.output.final_norm(x, self.output.final_norm.initial_state(x.shape[0]))[0]
        if tokens.shape[1] == 1 and cache.pack is not None and not torch.is_grad_enabled():
            return self._step(tokens[:, 0], cache).unsqueeze(1)
        c, outs, start = self.cfg["chunk_size"], [], 0
        while start < tokens.shape[1]:  # pieces never cross a chunk boundary unless they start on one
            offset = cache.position % c
            n = tokens.shape[1] - start if offset == 0 else min(c - offset, tokens.shape[1] - start)
            x = self.embed_tokens(tokens[:, start : start + n])
            for block, state in zip(self.layers, cache.layers_state):
                x, _ = self._block(block, x, state, cache.position)
            x, cache.final_norm = self.output.final_norm(x, cache.final_norm)
            outs.append(x)
            cache.position += n
            start += n
        return torch.cat(outs, 1) if outs else self.embed_tokens(tokens)

    def _block(self, block: MegalodonBlock, x: Tensor, state: _MegalodonLayerState | None, pos: int):
        """One block over x [B, L, D] float32 at stream position ``pos``; ``state`` is updated in place."""
        cfg, att = self.cfg, block.mega
        b, length, _ = x.shape
        h, c = cfg["num_heads"], cfg["chunk_size"]
        norm = att.timenorm.initial_state(b) if state is None else state.norm
        x_hat, norm = att.timenorm(x, norm)
        cema_out, h_last = att.cema(x_hat, None if state is None else state.cema)
        m = att.rmsnorm(cema_out)
        z = _linear(m, att.wz).view(b, length, h, -1)
        v = F.silu(_linear(x_hat, att.wv)).view(b, length, h, -1).transpose(1, 2)
        r = _linear(m, att.wr)
        offset = pos % c
        zn = _rms(z, cfg["norm_eps"])
        zd = z.shape[-1]
        scale = (1 + att.gamma.float().view(2, 1, 1, h, zd)) / math.sqrt(zd)
        qk = zn.unsqueeze(0) * scale + att.beta.float().view(2, 1, 1, h, zd)
        cos, sin = self.rope(x.device)
        positions = (torch.arange(length, device=x.device) + offset) % c
        qk = _rope(qk, cos[positions], sin[positions]).transpose(2, 3)  # [2, B, h, L, zd]
        q, k = qk[0], qk[1]
        if offset == 0:
            o = _chunk_attention(q, k, v, c)
            tail = length % c  # the keys / values of an unfinished last chunk stay cached
            if state is not None and tail:
                state.keys = _room(state.keys, k, tail, c)
                state.values = _room(state.values, v, tail, c)
                state.keys[:, :, :tail] = k[:, :, length - tail :]
                state.values[:, :, :tail] = v[:, :, length - tail :]
        else:
            end = offset + length
            state.keys, state.values = _room(state.keys, k, end, c), _room(state.values, v, end, c)
            state.keys[:, :, offset:end] = k
            state.values[:, :, offset:end] = v
            o = _attend_after(q, state.keys[:, :, :end], state.values[:, :, :end], offset, 1.0)
        if state is not None:
            state.norm, state.cema = norm, h_last
        o = o.transpose(1, 2).reshape(b, length, -1)
        out = _linear(m, att.wh1) + _linear(o * F.silu(r), att.wh2)
        y = out + x
        return x + block.nffn(y), state

    @torch.no_grad()
    def _step(self, tokens: Tensor, cache: MegalodonCache) -> Tensor:
        """One token per row through the packed weights: tokens [B] -> final normalised hidden states [B, D]."""
        pack, cfg = cache.pack, self.cfg
        c, eps = cfg["chunk_size"], cfg["norm_eps"]
        offset = cache.position % c
        cos, sin = self.rope(tokens.device)
        cos, sin = cos[offset], sin[offset]
        x = self.embed_tokens(tokens)
        bsz = x.shape[0]
        for pk, state in zip(pack.blocks, cache.layers_state):
            x_hat, state.norm = _timestep_norm_step(x, state.norm, pk.tn_w1, pk.tn_b, pk.groups, eps)
            px = pk.p * x_hat.unsqueeze(-1)
            hc = px.to(pk.q.dtype) if state.cema is None else torch.addcmul(px, pk.q, state.cema)
            state.cema = hc
            cema_out = torch.addcmul(torch.linalg.vecdot(pk.gamma_conj, hc).real, pk.omega, x_hat)
            m = _rms(cema_out, eps)
            zrh = pk.gemv_m(m)  # [B, Z + E + D]
            z = zrh[:, : pk.z].view(bsz, pk.h, pk.zd)
            qk = torch.addcmul(pk.qk_beta, _rms(z, eps), pk.qk_scale)  # [2, B, h, zd]
            a, b = qk.unflatten(-1, (pk.zd // 2, 2)).unbind(-1)
            qk = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).view(2, bsz, pk.h, 1, pk.zd)
            v = F.silu(pk.gemv_v(x_hat)).view(bsz, pk.h, 1, pk.e // pk.h)
            state.keys, state.values = (
                _room(state.keys, qk[1], offset + 1, c),
                _room(state.values, v, offset + 1, c),
            )
            state.keys[:, :, offset : offset + 1] = qk[1]
            state.values[:, :, offset : offset + 1] = v
            o = _attend_one(qk[0], state.keys[:, :, : offset + 1], state.values[:, :, : offset + 1], 1.0)
            r = F.silu(zrh[:, pk.z : pk.z + pk.e])
            y = pk.gemv_h2(o.view(bsz, pk.e) * r, add=zrh[:, pk.z + pk.e :]).add_(x)  # H + X
            u = F.layer_norm(y, (pk.d,), None, None, pk.ln_eps)
            g = pk.gemv_13(u)
            act = F.silu(g[:, : pk.ffn_dim]) * g[:, pk.ffn_dim :] if pk.swiglu else F.silu(g)
            x = pk.gemv_2(act, add=x)
        x, cache.final_norm = _timestep_norm_step(
            x, cache.final_norm, pack.final_w1, pack.final_b, self.output.final_norm.groups, eps
        )
        cache.position += 1
        return x


def _chunk_attention(q: Tensor, k: Tensor, v: Tensor, c: int) -> Tensor:
    """Causal softmax attention (scale 1) inside chunks of c tokens: q, k [B, h, L, dk], v [B, h, L, dv]."""
    b, h, length, _ = q.shape
    full = length // c * c
    outs = []
    if full:
        fold = lambda t: (
            t[:, :, :full].reshape(b, h, full // c, c, -1).transpose(1, 2).reshape(b * (full // c), h, c, -1)
        )  # noqa: E731
        o = F.scaled_dot_product_attention(fold(q), fold(k), fold(v), is_causal=True, scale=1.0)
        outs.append(o.reshape(b, full // c, h, c, -1).transpose(1, 2).reshape(b, h, full, -1))
    if length > full:
        tail = (t[:, :, full:] for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(*tail, is_causal=True, scale=1.0))
    return torch.cat(outs, 2) if len(outs) > 1 else outs[0]


# --------------------------------------------------------------------------- Llama


class LlamaAttention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))


class LlamaFFN(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return _linear(F.silu(_linear(x, self.w1)) * _linear(x, self.w3), self.w2)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, eps = cfg["model_dim"], cfg["norm_eps"]
        self.attention_norm = RMSNorm(d, eps, plus_one=False)
        self.attention = LlamaAttention(d)
        self.ffn_norm = RMSNorm(d, eps, plus_one=False)
        self.feed_forward = LlamaFFN(d, cfg["ffn_hidden_dim"])


class LlamaCache(_StateCache):
    """Llama's decoding state (the suite's ``KVCache``): the window's token ids from ``lo`` and per block the
    keys / values at window positions 0 .. position - lo - 1 (buffers that grow to ``max_seq_len`` rows)."""

    def __init__(self, model: LlamaLM, batch: int, device: torch.device):
        super().__init__(len(model.layers))
        self.lo = 0
        self.tokens = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.keys: list[Tensor | None] = [None] * len(model.layers)  # [B, h, n, hd]
        self.values: list[Tensor | None] = [None] * len(model.layers)
        self.pack = None

    def _map_rows(self, fn) -> None:
        self.tokens = fn(self.tokens)
        self.keys = [None if t is None else fn(t) for t in self.keys]
        self.values = [None if t is None else fn(t) for t in self.values]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]


class _LlamaPack:
    """Per block [W_q | W_k | W_v] and [W_1 | W_3] with the RMSNorm weights folded in, W_o, W_2; the final
    norm's weight and the head."""

    def __init__(self, model: LlamaLM):
        f = lambda t: t.detach().float()  # noqa: E731
        self.key = _params_key(model)
        self.blocks = []
        for blk in model.layers:
            a, ffn = blk.attention, blk.feed_forward
            qkv = torch.cat([f(a.wq.weight), f(a.wk.weight), f(a.wv.weight)]) * f(blk.attention_norm.weight)
            w13 = torch.cat([f(ffn.w1.weight), f(ffn.w3.weight)]) * f(blk.ffn_norm.weight)
            gemvs = (qkv, f(a.wo.weight), w13, f(ffn.w2.weight))
            self.blocks.append(tuple(_Gemv(w, None) for w in gemvs))
        self.final_w = f(model.final_norm.weight)
        self.head = _Gemv(f(model.output.weight), None)


class LlamaLM(nn.Module):
    """The suite's Llama-2 baseline (parameter names as the suite's)."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg["vocab_size"], cfg["model_dim"])
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg["num_layers"]))
        self.final_norm = RMSNorm(cfg["model_dim"], cfg["norm_eps"], plus_one=False)
        self.output = nn.Linear(cfg["model_dim"], cfg["vocab_size"], bias=False)
        if cfg["share_emb"]:
            self.output.weight = self.embed.weight
        self.window = cfg["max_seq_len"]
        self.stride = cfg.get("eval_stride") or self.window // 2
        self._pack: _LlamaPack | None = None
        self._rope: dict = {}

    def output_projection(self) -> nn.Linear:
        return self.output

    def context_start(self, t: int) -> int:
        """The first position that position ``t`` sees: the sliding window of the suite's decoder."""
        return max(0, (t // self.stride) * self.stride - (self.window - self.stride))

    def new_cache(self, batch: int, device: torch.device | None = None) -> LlamaCache:
        cache = LlamaCache(self, batch, device or self.embed.weight.device)
        if not torch.is_grad_enabled():
            if self._pack is None or self._pack.key != _params_key(self):
                self._pack = _LlamaPack(self)
            cache.pack = self._pack
        return cache

    def rope(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._rope:
            cfg = self.cfg
            self._rope[device] = _rope_table(
                cfg["model_dim"] // cfg["num_heads"], cfg["rope_base"], self.window, device
            )
        return self._rope[device]

    def logits(self, x: Tensor) -> Tensor:
        return F.linear(x, self.output.weight.float())

    def forward(self, tokens: Tensor, cache: LlamaCache | None) -> Tensor:
        """tokens [B, L] -> final normalised hidden states [B, L, D]. Without a cache, L <= max_seq_len is one
        causal pass; longer sequences, and any call with a cache, follow the sliding window."""
        if cache is None:
            if tokens.shape[1] <= self.window:
                return self._pass(tokens, None, 0)
            cache = LlamaCache(self, tokens.shape[0], tokens.device)  # the window's passes, nothing kept
        outs, done, length = [], 0, tokens.shape[1]
        while done < length:
            t = cache.position
            lo = self.context_start(t)
            n = 1  # the run of new positions that share this window start
            while done + n < length and self.context_start(t + n) == lo:
                n += 1
            piece = tokens[:, done : done + n]
            if lo != cache.lo:  # the window moved: one pass over its tokens
                known = cache.tokens[:, lo - cache.lo :]
                cache.lo = lo
                x = self._pass(torch.cat([known, piece], 1), cache, 0)[:, known.shape[1] :]
                cache.tokens = known
            elif n == 1 and cache.pack is not None and not torch.is_grad_enabled():
                x = self._step(piece[:, 0], cache, t - lo).unsqueeze(1)
            else:
                x = self._pass(piece, cache, t - lo)
            cache.tokens = torch.cat([cache.tokens, piece], 1)
            cache.position += n
            outs.append(x)
            done += n
        return torch.cat(outs, 1)

    def _pass(self, tokens: Tensor, cache: LlamaCache | None, start: int) -> Tensor:
        """Blocks over ``tokens`` at window positions start..; their keys / values stored in ``cache``. From
        position 0 this is the suite's full pass, op for op."""
        cfg = self.cfg
        h = cfg["num_heads"]
        x = self.embed(tokens).float()
        b, length, _ = x.shape
        cos, sin = self.rope(x.device)
        cos, sin = cos[start : start + length], sin[start : start + length]
        end = start + length
        for i, block in enumerate(self.layers):
            a = block.attention
            u = block.attention_norm(x)
            q, k, v = (_linear(u, w).view(b, length, h, -1) for w in (a.wq, a.wk, a.wv))
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if cache is not None:
                cache.keys[i] = _room(cache.keys[i], k, end, self.window)
                cache.values[i] = _room(cache.values[i], v, end, self.window)
                cache.keys[i][:, :, start:end] = k
                cache.values[i][:, :, start:end] = v
            if start == 0:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                o = _attend_after(q, cache.keys[i][:, :, :end], cache.values[i][:, :, :end], start, None)
            hres = x + _linear(o.transpose(1, 2).reshape(b, length, -1), a.wo)
            x = hres + block.feed_forward(block.ffn_norm(hres))
        return self.final_norm(x)

    @torch.no_grad()
    def _step(self, tokens: Tensor, cache: LlamaCache, pos: int) -> Tensor:
        """One token per row at window position ``pos`` through the packed weights -> hidden states [B, D]."""
        cfg, pack = self.cfg, cache.pack
        h, eps = cfg["num_heads"], cfg["norm_eps"]
        cos, sin = self.rope(tokens.device)
        cos, sin = cos[pos], sin[pos]
        x = self.embed(tokens).float()
        bsz, d = x.shape
        hd = d // h
        scale = 1 / math.sqrt(hd)
        for i, (qkv_w, wo, w13, w2) in enumerate(pack.blocks):
            qkv = qkv_w(_rms(x, eps)).view(bsz, 3, h, hd // 2, 2)
            a, b = qkv[:, :2].unbind(-1)
            qk = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).view(bsz, 2, h, 1, hd)
            v = qkv[:, 2].reshape(bsz, h, 1, hd)
            cache.keys[i] = _room(cache.keys[i], v, pos + 1, self.window)
            cache.values[i] = _room(cache.values[i], v, pos + 1, self.window)
            cache.keys[i][:, :, pos : pos + 1] = qk[:, 1]
            cache.values[i][:, :, pos : pos + 1] = v
            o = _attend_one(qk[:, 0], cache.keys[i][:, :, : pos + 1], cache.values[i][:, :, : pos + 1], scale)
            hres = wo(o.view(bsz, d), add=x)
            g = w13(_rms(hres, eps))
            f = g.shape[1] // 2
            x = w2(F.silu(g[:, :f]) * g[:, f:], add=hres)
        return _rms(x, eps) * pack.final_w


# --------------------------------------------------------------------------- transformers wrapper

ARCHS = {"megalodon": MegalodonLM, "llama": LlamaLM}


class MegaSuiteForCausalLM(PreTrainedModel, GenerationMixin):
    """A mega-suite language model as a transformers causal LM: ``.model`` holds the suite's module tree
    (the bundle's tensor names), ``forward`` takes and returns the model's cache."""

    config_class = MegaSuiteConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True  # the cache cannot be cropped: no assisted decoding

    def __init__(self, config: MegaSuiteConfig):
        super().__init__(config)
        if config.arch not in ARCHS:
            raise ValueError(f"config.json: arch={config.arch!r}, expected one of {sorted(ARCHS)}")
        self.model = ARCHS[config.arch](dict(config.suite_config))
        self._tied_weights_keys = dict(config.tied_weights) or None
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward creates the model's own cache on the first call

    def _init_weights(self, module) -> None:
        pass  # every tensor comes from the bundle's weights

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.output_projection()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: Cache | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """input_ids [B, L] -> logits [B, L, V] float32 (the last ``logits_to_keep`` positions when > 0).

        ``labels`` [B, L] (-100 ignored): the mean cross-entropy of predicting labels[:, t + 1] at t. With a
        ``cache`` (or ``use_cache``, the default outside training) the call continues a stream and returns the
        updated cache: one token per call is the decoding step."""
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("mega-suite models take input_ids, not inputs_embeds")
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] == 0:
            shape = None if input_ids is None else tuple(input_ids.shape)
            raise ValueError(f"input_ids must be a non-empty [batch, length] tensor, got {shape}")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                "mega-suite models take no padding mask: give rows of the same length (batch size 1, or prompts "
                "of equal length)"
            )
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True)) and not self.training and labels is None
        if cache is None and use_cache:
            cache = self.model.new_cache(input_ids.shape[0])
        if cache is not None and cache.batch_size != input_ids.shape[0]:
            raise ValueError(f"the cache holds {cache.batch_size} rows, input_ids has {input_ids.shape[0]}")
        hidden = self.model(input_ids, cache)
        if labels is None and logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        if (
            hidden.shape[1] == 1
            and cache is not None
            and cache.pack is not None
            and not torch.is_grad_enabled()
        ):
            logits = cache.pack.head(hidden[:, 0]).unsqueeze(1)  # the head as the one-token step stores it
        else:
            logits = self.model.logits(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})

    def suite_model(self):
        """The wrapped module tree (``MegalodonLM`` or ``LlamaLM`` of this file)."""
        return self.model
