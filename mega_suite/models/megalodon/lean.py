"""Autograd Functions that store less for backward than autograd would, with the same math.

- ``silu_gate_linear(g, a, W) = (SiLU(g) ⊙ a) Wᵀ`` (``a`` optional): keeps g and a, not SiLU(g) nor the
  product that the Linear would keep; both are recomputed in backward (two elementwise ops).
- ``dropout(x, p, training)``: on CPU ``F.dropout`` keeps its float noise tensor ([B, L, D] of 0 and
  1/(1-p)); this draws the same noise from the same generator and keeps it as bool (1 byte per element).
- ``recompute_saved(((t, ...), fn), ...)``: inside the context, autograd stores views of the tensors t as a
  recipe and rebuilds them from ``fn()`` when backward reads them. The block rebuilds the outputs of its
  narrow-input Linears from inputs it keeps anyway: V = SiLU(X̂ W_v + b) and X̂ W_v + b from X̂, M W_r + b
  from M, the FFN's u W_1 (and u W_3) from u (``rebuild_linear``): one GEMM in backward each, instead of
  E or F floats per token stored.
- ``recompute(fn, *xs)``: an elementwise / normalisation piece whose intermediates are recomputed from its
  inputs in backward (a checkpoint of a few cheap ops, not of a block: matmuls, attention and FFTs are never
  recomputed). ``fn`` must be deterministic (no dropout) and contain no autocast-listed op.

What a block stores, per node, is printed by ``python -m bench.diagnostics.saved_bytes``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.recompute import recompute

__all__ = ["silu_gate_linear", "recompute", "recompute_saved", "rebuild_linear", "dropout"]


class _SiluGateLinear(torch.autograd.Function):
    """y = (SiLU(g) ⊙ a) Wᵀ, or SiLU(g) Wᵀ without ``a``; the matmul runs in the dtype autocast gives it
    (backward too: d(gated) = dy W and dW = dyᵀ gated in that dtype, cast back as autocast's casts would)."""

    @staticmethod
    def forward(ctx, g: Tensor, a: Tensor | None, weight: Tensor) -> Tensor:
        s = F.silu(g)
        gated = s if a is None else s * a
        y = F.linear(gated, weight)
        ctx.save_for_backward(g, a, weight)
        ctx.gated_dtype, ctx.mm_dtype = gated.dtype, y.dtype
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        g, a, weight = ctx.saved_tensors
        s = F.silu(g)
        gated = s if a is None else s * a
        dy = grad.to(ctx.mm_dtype)
        grad_weight = None
        if ctx.needs_input_grad[2]:
            flat = gated.to(ctx.mm_dtype).reshape(-1, gated.shape[-1])
            grad_weight = (dy.reshape(-1, dy.shape[-1]).t() @ flat).to(weight.dtype)
        d_gated = (dy @ weight.to(ctx.mm_dtype)).to(ctx.gated_dtype)
        grad_a = None
        if a is not None:
            grad_a = d_gated * s if ctx.needs_input_grad[1] else None
            d_gated = d_gated * a
        grad_g = torch.ops.aten.silu_backward(d_gated, g) if ctx.needs_input_grad[0] else None
        return grad_g, grad_a, grad_weight


def silu_gate_linear(g: Tensor, a: Tensor | None, weight: Tensor) -> Tensor:
    """(SiLU(g) ⊙ a) Wᵀ (no bias), storing g, a and W for backward: g, a [..., F]; W [out, F]."""
    return _SiluGateLinear.apply(g, a, weight)


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        # at::dropout's CPU path: noise = bernoulli(1 - p) / (1 - p); x * noise (same draws, same values).
        noise = torch.empty_like(x).bernoulli_(1 - p)
        ctx.save_for_backward(noise.bool())
        ctx.p = p
        return x * noise.div_(1 - p)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (keep,) = ctx.saved_tensors
        return grad * keep.to(grad.dtype).div_(1 - ctx.p), None


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``F.dropout(x, p, training)`` storing a bool mask for backward (CPU; elsewhere F.dropout, whose
    fused kernel already stores one)."""
    if not training or not 0.0 < p < 1.0 or x.device.type != "cpu" or not torch.is_grad_enabled():
        return F.dropout(x, p, training)
    return _Dropout.apply(x, p)


_REBUILT: weakref.WeakValueDictionary = (
    weakref.WeakValueDictionary()
)  # storage address -> tensor, while alive


def is_rebuilt(t: Tensor) -> bool:
    """Whether ``t`` (a saved tensor read back) was rebuilt by ``recompute_saved`` rather than stored."""
    return t.untyped_storage().data_ptr() in _REBUILT


class _Recipe:
    __slots__ = ("group", "index", "shape", "stride", "offset")

    def __init__(self, group: int, index: int, t: Tensor):
        self.group, self.index = group, index
        self.shape, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()


def _outer_saved_tensor_hooks() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # private, torch >= 2.0
    return top is not None and top(False) is not None


@contextlib.contextmanager
def recompute_saved(*groups: tuple[tuple[Tensor, ...], Callable[[], tuple[Tensor, ...]]]) -> Iterator[None]:
    """Each group is (tensors, fn) with fn() returning those tensors' values again, in their layouts. Tensors
    saved for backward inside the context that are views of one of them are stored as (shape, strides,
    offset) and rebuilt as the same view of fn()'s result; fn runs once, when backward first reads one.
    Neither the context nor fn may hold the tensors themselves (fn capturing one keeps it alive, stored after
    all); the caller must, until the context exits (they are matched by storage address, which a freed tensor
    would hand to another).
    Under torch.compile it does nothing: AOT autograd's partitioner decides what is saved. Inside another
    saved-tensor hook pair (non-reentrant activation checkpointing, which recomputes the whole block anyway)
    it does nothing either: only the innermost pair applies, so the outer one would not see what is saved
    here (checkpointing kept attention's Q, K, O that way), and fn would keep its inputs alive."""
    if torch.compiler.is_compiling() or _outer_saved_tensor_hooks():
        yield
        return
    where = {
        (t.untyped_storage().data_ptr(), t.dtype): (g, i)
        for g, (ts, _) in enumerate(groups)
        for i, t in enumerate(ts)
        if t.numel()  # an empty tensor has no storage address of its own
    }
    fns = tuple(fn for _, fn in groups)  # the hooks must not refer to the tensors: they would stay alive
    del groups
    rebuilt: dict[int, tuple[Tensor, ...]] = {}  # freed with the last recipe that refers to this closure

    def pack(s: Tensor):
        key = where.get((s.untyped_storage().data_ptr(), s.dtype))
        return s if key is None else _Recipe(*key, s)

    def unpack(s):
        if not isinstance(s, _Recipe):
            return s
        if s.group not in rebuilt:
            with torch.no_grad():
                rebuilt[s.group] = tuple(fns[s.group]())
            for t in rebuilt[s.group]:
                _REBUILT[t.untyped_storage().data_ptr()] = t
        return rebuilt[s.group][s.index].as_strided(s.shape, s.stride, s.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def rebuild_linear(x: Tensor, weight: Tensor, bias: Tensor | None, like: Tensor) -> Callable[[], Tensor]:
    """A function giving ``F.linear(x, weight, bias)`` again, as ``like`` (its forward result) was computed,
    once: its value is kept after the first call, so groups of ``recompute_saved`` can share one GEMM.

    Under autocast, forward's Linear cast x, W and b to the autocast dtype; backward may run outside autocast,
    so the rebuild makes those casts itself (the same values) and runs with autocast off. ``weight`` and
    ``bias`` are the tensors forward used (under FSDP2 the unsharded ones, gathered again for backward)."""
    dtype, device, value = like.dtype, like.device.type, []  # not ``like`` itself: it is what is not stored

    def fn() -> Tensor:
        if not value:
            with torch.autocast(device, enabled=False):
                b = None if bias is None else bias.to(dtype)
                value.append(F.linear(x.to(dtype), weight.to(dtype), b))
        return value[0]

    return fn
