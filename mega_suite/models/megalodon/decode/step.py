"""One block, one token, from packed weights: the equations of ``MegalodonBlock.forward`` with a cache
(docs/architecture.md#the-block, #streaming), each op's one-token form taken from beside its kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention import attention_step
from kernels.cema import cema_token_step, cema_token_step_real
from kernels.timestep_norm import timestep_norm_step
from mega_suite.models.megalodon.cache import ChunkKV, LayerCache
from mega_suite.models.megalodon.decode.pack import BlockPack


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
