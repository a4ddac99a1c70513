"""The one-token step: the equations of ``MegalodonBlock.forward`` with a cache for a single token, from packed
weights (``pack.py``; docs/architecture.md#the-block, #streaming, docs/long_context.md#the-one-token-step),
each op's one-token form taken from beside its kernels. The model's own forward with a cache takes it for
one or two new tokens (``MegalodonLM.forward``), ``decode.Decoder`` for one; this module sits below both.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.attention import attention_step
from kernels.cema import cema_token_step, cema_token_step_real
from kernels.timestep_norm import timestep_norm_step
from mega_suite.models.megalodon.cache import ChunkKV, LayerCache, StreamingCache, advance_windows
from mega_suite.models.megalodon.pack import BlockPack, DecodePlan

MODEL_PLAN = (torch.float32, "matmul", None)  # the options of the plan a model keeps for its own forward
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its MODEL_PLAN plan


def can_step(model: nn.Module) -> bool:
    """The one-token step applies to ``model`` (a ``MegalodonLM``): no autograd, a float32 model (float64 ones
    keep the streaming pass), token embeddings (not the adaptive input) and unsharded blocks (the step
    bypasses FSDP2's hooks)."""
    # deferred: building a model does not import torch.distributed
    from torch.distributed.fsdp import FSDPModule

    return (
        not torch.is_grad_enabled()
        and model.output.final_norm.weight.dtype == torch.float32
        and not model.adaptive
        and not isinstance(model.layers[0], FSDPModule)
    )


def model_plan(model: nn.Module) -> DecodePlan:
    """The float32 ``matmul`` plan of ``model``, shared by its forward and every default ``decode.Decoder`` on
    it: packed at first use and again whenever it is stale (``DecodePlan.is_current``), kept while the model
    lives (one packed copy of the weights) and dropped by ``drop_model_plan``."""
    plan = _PLANS.get(model)
    if plan is None or not plan.is_current(model, *MODEL_PLAN):
        _PLANS.pop(model, None)  # the stale packs go before the new ones are made: never two copies
        plan = _PLANS[model] = DecodePlan(model, *MODEL_PLAN)
    return plan


def drop_model_plan(model: nn.Module) -> None:
    _PLANS.pop(model, None)


def rms_scale(x: Tensor, eps_t: Tensor, n: int) -> Tensor:
    """1 / sqrt(mean(x²) + eps) over the last dim, as rsqrt(eps + ‖x‖²/n) (one reduction: a norm)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return torch.rsqrt(torch.addcmul(eps_t, norm, norm, value=1.0 / n))


def block_in(pk: BlockPack, x: Tensor, norm_state, cema_state: Tensor | None, rope_row: Tensor):
    """The first half of a block's step, up to the new token's q, k, v. ``rope_row`` is the RoPE rotation of
    the token's chunk offset, [..., zd/2] complex or (cos, sin) pairs [..., zd/2, 2]; ``cema_state``
    [B, D, N] complex, (Re, Im) pairs [B, D, N, 2] (real arithmetic; the new state comes back in the same
    form) or None (zeros). Returns (q, k [B, 1, h, zd], v [B, 1, h, E/h], r [B, E], m W_h1 + b_h1 [B, D],
    norm state, CEMA state)."""
    bsz, h, zd, z, e = x.shape[0], pk.h, pk.zd, pk.z, pk.e
    x_hat, norm_state = timestep_norm_step(x, norm_state, pk.tn_w1, pk.tn_b, pk.groups, pk.eps)
    px = pk.p * x_hat.unsqueeze(-1)
    if cema_state is not None and not cema_state.is_complex():  # [B, D, N, 2]: (Re, Im)
        cema_out, state = cema_token_step_real(px, x_hat, pk.q_ri, pk.gamma_ri, pk.omega, cema_state)
    else:
        cema_out, state = cema_token_step(px, x_hat, pk.q, pk.gamma_c, pk.omega, cema_state)
    m = cema_out * rms_scale(cema_out, pk.rms_eps_t, pk.d)  # (1 + w) is in the m-pack's weights
    zrh = pk.gemv_m(m)  # [B, Z + E + D]: z, r, and m W_h1 + b_h1
    zh = zrh[:, :z].view(bsz, h, zd)
    qk = torch.addcmul(pk.qk_beta, zh, rms_scale(zh, pk.eps_t, zd) * pk.qk_scale)  # [2, B, h, zd]
    qk = qk.view(2, bsz, h, zd // 2, 2)
    if rope_row.is_complex():
        qk = torch.view_as_real(torch.view_as_complex(qk) * rope_row)
    else:  # (a + ib)(c + is) on (Re, Im) pairs
        a, b = qk.unbind(-1)
        c, s = rope_row.unbind(-1)
        qk = torch.stack((a * c - b * s, a * s + b * c), -1)
    qk = qk.view(2, bsz, 1, h, zd)
    v = F.silu(pk.gemv_v(x_hat)).view(bsz, 1, h, e // h)
    r = F.silu(zrh[:, z : z + e])
    return qk[0], qk[1], v, r, zrh[:, z + e :], norm_state, state


def block_out(pk: BlockPack, x: Tensor, q: Tensor, keys: Tensor, values: Tensor, mask, r: Tensor, h1: Tensor):
    """The second half: softmax(q kᵀ) v over the chunk's keys [B, n, h, zd] (``mask`` [n] True = not yet
    written, or None), the gate, the W_h2 GEMV onto m W_h1 + b_h1, the residual, then the FFN."""
    bsz = x.shape[0]
    o = attention_step(q, keys, values, mask)  # [B, h, 1, E/h]
    y = pk.gemv_h2((o.view(bsz, pk.e) * r), add=h1).add_(x)  # H + X
    u = F.layer_norm(y, (pk.d,), None, None, pk.ln_eps)
    g = pk.gemv_13(u)
    a = F.silu(g[:, : pk.ffn_dim]) * g[:, pk.ffn_dim :] if pk.swiglu else F.silu(g)
    return pk.gemv_2(a, add=x)


def block_step(pk: BlockPack, x: Tensor, cache: LayerCache, pos: int) -> tuple[Tensor, LayerCache]:
    """One block, one token: x [B, D] float32 at absolute position ``pos`` -> (X + FFN(LN(H + X)), cache)."""
    offset = pos % pk.chunk
    q, k, v, r, h1, norm_state, state = block_in(pk, x, cache.norm, cache.cema, pk.rope[offset])
    if cache.kv is None or offset == 0:
        kdt = pk.kv_dtype or k.dtype
        kv = ChunkKV.new(k.to(kdt), v.to(kdt), pk.chunk)
    else:
        # None: the chunk's dtype (bf16 when its earlier tokens ran under autocast); a prompt's cache held in
        # another dtype than ``kv_dtype`` is converted once, at the chunk's first step
        kdt = pk.kv_dtype or cache.kv.k_buf.dtype
        kv = cache.kv.to(kdt).append(k.to(kdt), v.to(kdt))
    out = block_out(pk, x, q, kv.keys, kv.values, None, r, h1)
    full = offset + 1 == pk.chunk
    return out, LayerCache(norm_state, state, None if full else kv, cache.window)


def stream_step(
    model: nn.Module, plan: DecodePlan, tokens: Tensor, cache: StreamingCache
) -> tuple[Tensor, StreamingCache]:
    """tokens [B] at ``cache.position`` -> (final normalised hidden states [B, D], cache) of ``model`` from
    ``plan``'s packs. Autocast is off: the plan's weight dtype decides the GEMVs' precision, everything else
    is float32."""
    with torch.autocast(tokens.device.type, enabled=False):
        pos = cache.position
        x = model.embed_tokens(tokens)
        layers = []
        for pack, lc in zip(plan.blocks, cache.layers):
            x, lc = block_step(pack, x, lc, pos)
            layers.append(lc)
        x, final = timestep_norm_step(
            x, cache.final_norm, plan.final_w1, plan.final_b, plan.final_groups, plan.final_eps
        )
    new = StreamingCache(pos + 1, layers, final, cache.window_stats, cache.final_window)
    chunk = model.cfg.chunk_size
    if cache.window_stats and (pos + 1) % chunk == 0:
        advance_windows(new, chunk)
    return x, new
