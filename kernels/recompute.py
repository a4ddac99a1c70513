"""``recompute(fn, *xs)``: fn(*xs) storing only xs for backward, where fn runs again to differentiate.

For a few cheap ops (normalisations, elementwise chains, the CEMA kernel) whose intermediates would
otherwise be kept for backward; matmuls, attention and FFTs over the batch are never put inside.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["recompute"]


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable, *xs: Tensor):
        ctx.fn = fn
        ctx.save_for_backward(*xs)
        ctx.set_materialize_grads(False)  # an output nobody used gets no backward pass
        device = xs[0].device.type
        ctx.autocast = device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)
        with torch.no_grad():
            return fn(*xs)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        xs = ctx.saved_tensors
        need = ctx.needs_input_grad[1:]
        inputs = [x.detach().requires_grad_(n) for x, n in zip(xs, need)]
        device, dtype, enabled = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype, enabled):  # the forward's autocast state
            outs = ctx.fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [x for x, n in zip(inputs, need) if n]
        got = iter(
            torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
            if pairs and wanted
            else [None] * len(wanted)
        )
        return (None, *(next(got) if n else None for n in need))


def recompute(fn: Callable[..., Tensor | tuple[Tensor, ...]], *xs: Tensor):
    """``fn(*xs)``, storing only ``xs`` for backward, where ``fn`` runs again to differentiate.

    Every tensor that needs a gradient must be among ``xs`` (parameters included); without autograd it is
    just ``fn(*xs)``.
    """
    # Under torch.compile, plain fn: Dynamo cannot trace the autograd.grad of the backward (the block
    # would fall back to eager), and AOT autograd's partitioner chooses what to recompute itself.
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not any(x.requires_grad for x in xs):
        return fn(*xs)
    return _Recompute.apply(fn, *xs)
