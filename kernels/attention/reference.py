"""Chunked (block-diagonal) attention, docs/architecture.md#normalised-attention, in plain PyTorch.

Chunks are folded into the batch and handed to ``scaled_dot_product_attention`` with scale 1.0
(Q and K arrive normalised and learnably scaled). Cost O(L * C) in time and memory.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["chunk_attention", "attention_with_cache"]


def _fold(t: Tensor, nc: int, c: int) -> Tensor:
    """[B, nc*c, h, d] -> [B*nc, h, c, d]."""
    b, _, h, d = t.shape
    return t.reshape(b, nc, c, h, d).permute(0, 1, 3, 2, 4).reshape(b * nc, h, c, d)


_MASK_BUDGET = 1 << 22  # elements of one attention-mask block (4M: 4 MB as bool, 16 MB as SDPA's float)


class _FlashAttention(torch.autograd.Function):
    """CPU flash attention (scale 1) that stores Q, K, V at their own head widths.

    SDPA's flash kernel needs one head width, so Q/K (or V) are zero-padded to max(dk, dv); autograd would
    keep the padded copies for backward. Here the unpadded Q, K, V, the unpadded output and the row
    log-sum-exp are kept, and backward re-pads them for ``aten._scaled_dot_product_flash_attention_for_cpu
    _backward``: zero columns of Q/K add 0 to every score, zero columns of V give zero output columns, so
    the padded forward and backward are exactly the unpadded attention (the same kernel as before).
    q, k: [N, h, C, dk]; v: [N, h, C, dv]; mask: additive float [N, 1, 1 or C, C] or None.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        dk, dv = q.shape[-1], v.shape[-1]
        width = max(dk, dv)
        qp, kp, vp = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] != width else t for t in (q, k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qp, kp, vp, 0.0, causal, attn_mask=mask, scale=1.0
        )
        out = out[..., :dv].contiguous() if dv != width else out
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, mask = ctx.saved_tensors
        dk, dv = q.shape[-1], v.shape[-1]
        width = max(dk, dv)

        def pad(t: Tensor) -> Tensor:
            return F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] != width else t

        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            pad(grad.contiguous()), pad(q), pad(k), pad(v), pad(out), lse, 0.0, ctx.causal,
            attn_mask=mask, scale=1.0,
        )  # fmt: skip
        return gq[..., :dk], gk[..., :dk], gv[..., :dv], None, None


_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _use_flash(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in _FLASH_DTYPES and k.dtype == v.dtype == q.dtype


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, flash: bool) -> Tensor:
    """SDPA with scale 1 (bool ``mask``: True = keep); ``flash``: the CPU flash kernel (``_FlashAttention``)."""
    if flash:
        if mask is not None:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        return _FlashAttention.apply(q, k, v, mask, False)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)


def _masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pad_keep: Tensor | None,
    causal: bool,
    dropout_p: float,
    row0: int,
    flash: bool = False,
) -> Tensor:
    """SDPA for query rows row0.. of every chunk with key padding, causality and DropKey as one bool mask.

    q: [N, h, rows, d]; k, v: [N, h, C, d]; pad_keep: [N, 1, 1, C] (True = real key) or None.
    """
    n, h, rows, _ = q.shape
    c = k.shape[2]
    keep = torch.ones(n, 1, 1, c, dtype=torch.bool, device=q.device) if pad_keep is None else pad_keep
    if causal:
        qi = torch.arange(row0, row0 + rows, device=q.device).view(rows, 1)
        keep = keep & (torch.arange(c, device=q.device).view(1, c) <= qi)
    if dropout_p > 0.0:
        drop = torch.empty(n, h, rows, c, dtype=torch.uint8, device=q.device).bernoulli_(dropout_p).bool()
        keep = keep & ~drop
    # A row with no valid key (padding, or every key dropped) would give NaN: let it attend anywhere, then
    # zero it, as the fused kernel does.
    no_key = ~keep.any(-1, keepdim=True)
    o = _sdpa(q, k, v, keep | no_key, flash)
    # Only when some row has no key: a masked copy would be stored for backward beside SDPA's own output.
    return o.masked_fill(no_key, 0.0) if bool(no_key.any()) else o


class _BlockedCausal(torch.autograd.Function):
    """Causal attention for unequal head widths (SDPA's math path) without the masked upper half and without
    storing the probabilities.

    Query block i attends only to keys up to its own end, so the scores computed are (blocks + 1) / (2 blocks)
    of C x C (5/8 for 4 blocks) instead of all of them (bench/reports/2026-11-24-cpu-causal-attention.md). Forward
    keeps Q, K, V, the output O and the row log-sum-exp; backward recomputes P = exp(Q Kᵀ - lse) block by
    block (the cheap dk-wide product) and applies dV = Pᵀ dO, dS = P ⊙ (dO Vᵀ - rowsum(dO ⊙ O)),
    dQ = dS K, dK = dSᵀ Q. bf16 / fp16 inputs are computed in float32, as SDPA's CPU math path does.
    q, k: [N, h, C, dk]; v: [N, h, C, dv].
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, blocks: int) -> Tensor:
        qa, ka, va = _acc(q), _acc(k), _acc(v)
        outs, lses = [], []
        for _, end, (p, lse) in _causal_blocks(qa, ka, None, blocks):
            lses.append(lse)
            outs.append(torch.matmul(p, va[:, :, :end]))
        out = torch.cat(outs, dim=2).to(v.dtype)
        ctx.save_for_backward(q, k, v, out, torch.cat(lses, dim=2))
        ctx.blocks = blocks
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        qa, ka, va, g = _acc(q), _acc(k), _acc(v), _acc(grad)
        delta = (g * _acc(out)).sum(-1, keepdim=True)  # rowsum(dO ⊙ O) = sum_j P_ij dP_ij
        dq, dk, dv = torch.empty_like(qa), torch.zeros_like(ka), torch.zeros_like(va)
        for start, end, (p, _) in _causal_blocks(qa, ka, lse, ctx.blocks):
            gb = g[:, :, start:end]
            dv[:, :, :end] += torch.matmul(p.transpose(-1, -2), gb)
            ds = p.mul_(torch.matmul(gb, va[:, :, :end].transpose(-1, -2)).sub_(delta[:, :, start:end]))
            dq[:, :, start:end] = torch.matmul(ds, ka[:, :, :end])
            dk[:, :, :end] += torch.matmul(ds.transpose(-1, -2), qa[:, :, start:end])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _acc(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _causal_blocks(q: Tensor, k: Tensor, lse: Tensor | None, blocks: int):
    """Yield (start, end, (P, lse)) per query block: P = softmax of the causal scores of rows start..end over
    keys < end, from ``lse`` when given (backward) or with its lse computed (forward)."""
    c = q.shape[2]
    rows = math.ceil(c / blocks)
    for start in range(0, c, rows):
        end = min(c, start + rows)
        s = torch.matmul(q[:, :, start:end], k[:, :, :end].transpose(-1, -2))
        qi = torch.arange(start, end, device=q.device).view(-1, 1)
        s.masked_fill_(torch.arange(end, device=q.device).view(1, -1) > qi, float("-inf"))
        if lse is not None:  # backward: P = exp(S - lse), one pass
            yield start, end, (s.sub_(lse[:, :, start:end]).exp_(), None)
            continue
        row_max = s.amax(-1, keepdim=True)  # forward: softmax's passes (max, exp, sum, divide) and lse
        total = s.sub_(row_max).exp_().sum(-1, keepdim=True)
        yield start, end, (s.div_(total), row_max.add_(total.log_()))


def _flash_friendly(b: int, c: int, h: int, dk: int, dv: int) -> bool:
    """Pad Q/K or V to a common head width so SDPA can use its memory-efficient (flash) CPU kernel?

    SDPA's flash kernels need equal head widths; otherwise it falls back to the math path, which stores the
    [B, h, C, C] probabilities. Padding with zeros is exact but costs extra Q.K^T FLOPs, so it pays when the
    widths are close or when the probabilities would be large (both measured on the CPU: bench/reports/2026-11-24-cpu-causal-attention.md).
    """
    if dk == dv:
        return False
    ratio = max(dk, dv) / min(dk, dv)
    return ratio <= 4 or b * h * c * c * 4 > (512 << 20)


def _prefer_blocked(n: int, c: int, dk: int, dv: int, dtype: torch.dtype) -> bool:
    """Causal, no padding, no dropout, dk != dv, ``n`` chunks x heads of C tokens: ``_BlockedCausal``
    (dk-wide scores, 5/8 of C x C, in float32) rather than Q and K padded to dv for SDPA's flash kernel?
    The rule below follows the grid ``python -m bench.diagnostics.attention_cpu`` measured on the CPU
    (bench/reports/2026-11-24-cpu-causal-attention.md): blocked wins wherever dv >= 256 or C <= 1024, flash with padded Q and K
    at C = 2048 with dv <= 128, where the elementwise passes over the materialised probabilities cost more
    than flash's wider products. Shapes this rule leaves to flash that ``_flash_friendly`` does not pad
    (dv / dk > 4 and probabilities under 512 MB) still run blocked.
    Padded flash also when the full probabilities would exceed 512 MB (blocked materialises a quarter of
    them at a time, twice that in backward), a size not measured here."""
    if c < 256 or dk == dv or n * c * c * 4 > (512 << 20):
        return False
    if dtype in (torch.bfloat16, torch.float16):
        return c <= 512 or dv >= 512
    return c <= 1024 or dv >= 256


def chunk_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    chunk_size: int,
    causal: bool,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Softmax attention inside independent chunks of ``chunk_size`` tokens.

    Args:
        q, k: [B, L, h, dk] (RoPE already applied, positions restarting per chunk).
        v: [B, L, h, dv]; dv may differ from dk.
        chunk_size: C; a length that is not a multiple of C is padded internally.
        causal: mask keys after the query inside each chunk.
        key_padding_mask: [B, L] bool, True = padding key.
        dropout_p: DropKey rate: each pre-softmax logit is masked (-inf) with this probability, no
            rescaling (callers pass 0 in eval). The same semantics as the fused Triton path.

    Returns:
        [B, L, h, dv]; a query with no valid key (padding, or every key dropped) outputs zeros.
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"chunk_attention expects q, k [B, L, h, dk] and v [B, L, h, dv]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    b, length, h, dk = q.shape
    dv = v.shape[-1]
    c = min(chunk_size, length)
    nc = math.ceil(length / c)
    pad = nc * c - length
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        if key_padding_mask is None:
            key_padding_mask = torch.zeros(b, length, dtype=torch.bool, device=q.device)
        key_padding_mask = F.pad(key_padding_mask, (0, pad), value=True)
    qf, kf, vf = _fold(q, nc, c), _fold(k, nc, c), _fold(v, nc, c)
    # CPU, causal, nothing masked: the faster of the two paths for these widths (measured on the CPU only)
    cpu_plain = q.device.type == "cpu" and causal and key_padding_mask is None and dropout_p == 0.0
    blocked = cpu_plain and _prefer_blocked(b * nc * h, c, dk, dv, q.dtype)
    width = dv
    friendly = not blocked and _flash_friendly(b * nc, c, h, dk, dv)
    if friendly and not _use_flash(qf, kf, vf):
        width = max(dk, dv)
        qf, kf = F.pad(qf, (0, width - dk)), F.pad(kf, (0, width - dk))
        vf = F.pad(vf, (0, width - dv))
    flash = _use_flash(qf, kf, vf) and (dk == dv or friendly)

    pad_keep = None if key_padding_mask is None else ~key_padding_mask.reshape(b * nc, 1, 1, c)
    if pad_keep is None and dropout_p == 0.0:
        if blocked:
            o = _BlockedCausal.apply(qf, kf, vf, 4)
        elif flash:
            o = _FlashAttention.apply(qf, kf, vf, None, causal)
        elif causal and qf.shape[-1] != vf.shape[-1] and c >= 256:
            o = _BlockedCausal.apply(qf, kf, vf, 4)
        else:
            o = F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, scale=1.0)
    elif dropout_p == 0.0 and not causal:  # key padding only: a broadcast [N, 1, 1, C] mask, no blocking
        o = _masked_attention(qf, kf, vf, pad_keep, False, 0.0, 0, flash)
    else:
        # Masks are [rows, C] per (chunk, head): process query rows in blocks small enough that the mask and
        # SDPA's float copy of it stay bounded, recomputing each block in backward (RNG state included).
        rows = max(1, min(c, _MASK_BUDGET // max(1, b * nc * h * c)))
        blocks = []
        for r0 in range(0, c, rows):
            args = (qf[:, :, r0 : r0 + rows], kf, vf, pad_keep, causal, dropout_p, r0, flash)
            if torch.is_grad_enabled() and rows < c:
                blocks.append(checkpoint(_masked_attention, *args, use_reentrant=False))
            else:
                blocks.append(_masked_attention(*args))
        o = torch.cat(blocks, dim=2) if len(blocks) > 1 else blocks[0]
    o = o[..., :dv] if width != dv else o
    o = o.reshape(b, nc, h, c, dv).permute(0, 1, 3, 2, 4).reshape(b, nc * c, h, dv)
    return o[:, :length] if pad else o


def attention_with_cache(q: Tensor, k: Tensor, v: Tensor, cache_len: int) -> Tensor:
    """Causal attention of new queries over [cached ; new] keys of the same chunk (streaming).

    q: [B, l, h, dk] for positions cache_len..cache_len+l-1 of the chunk; k, v: [B, cache_len + l, h, *].
    Returns [B, l, h, dv].
    """
    length = q.shape[1]
    total = k.shape[1]
    mask = None  # one new query sees every cached key and itself
    if length > 1:
        qi = torch.arange(length, device=q.device).view(length, 1) + cache_len
        mask = torch.arange(total, device=q.device).view(1, total) <= qi
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=1.0
    )
    return o.transpose(1, 2)
