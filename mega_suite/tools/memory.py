"""What autograd stores for backward, found by walking the graph (torch only: ``bench/diagnostics/saved_bytes.py`` loads
this file by path, so that it can measure an older checkout's model with it).

``malloc_live_bytes`` is the check from the other side: what the process's allocator has handed out, so a
tensor kept alive outside the graph (by a closure) shows up there and not in the walk.

Saved-tensor hooks cannot count this: only the innermost pair of hooks applies, so a counter installed around
a forward misses whatever is saved inside a model's own hooks (``lean.recompute_saved``, activation
checkpointing), and sees tensors those hooks do not store. The graph walk reads every saved tensor back
instead, the way backward would.
"""

from __future__ import annotations

import collections
import ctypes
from collections.abc import Callable, Iterable

import torch
from torch import Tensor


def stored_for_backward(
    outputs: Tensor | Iterable[Tensor],
    exclude: Iterable[Tensor] = (),
    rebuilt: Callable[[Tensor], bool] = lambda t: False,
) -> collections.Counter:
    """{(node, attribute, shape, dtype): storage bytes} that the graph behind ``outputs`` keeps for backward.

    Every saved tensor of every node (``_saved_*``, and ``saved_tensors`` of custom Functions) is read twice:
    one whose two reads differ in storage, or for which ``rebuilt(t)`` holds, is recomputed when read (a hook
    recipe, a checkpoint) and is not stored. Each storage counts once (views and tensors saved twice share
    it); the storages of ``exclude`` (inputs, parameters) do not count.

    Reading runs the unpack hooks: recipes are rebuilt, checkpointed blocks recomputed, and those results stay
    cached until backward or until the graph dies (a measuring tool, not for a training step). Not seen: a
    tensor held only by a hook's closure or set as a plain ``ctx`` attribute (kept alive, but not saved); the
    block tests compare malloc's live bytes with this count for that reason."""
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    by: collections.Counter = collections.Counter()
    stack, visited = [t.grad_fn for t in outputs], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in visited:
            continue
        visited.add(fn)
        names = [n for n in dir(fn) if n.startswith("_saved_")]
        if isinstance(fn, torch.autograd.function.BackwardCFunction):  # a custom autograd.Function
            names.append("saved_tensors")
        for name in names:
            try:
                value, again = getattr(fn, name), getattr(fn, name)
            except Exception:  # noqa: BLE001 - some saved attributes are not readable (freed, symbolic)
                continue
            name = name.removeprefix("_saved_")
            values = value if isinstance(value, (tuple, list)) else [value]
            agains = again if isinstance(again, (tuple, list)) else [again]
            for t, t2 in zip(values, agains):
                if not isinstance(t, Tensor) or t.numel() == 0:
                    continue
                storage = t.untyped_storage()
                if storage.data_ptr() != t2.untyped_storage().data_ptr() or rebuilt(t):
                    continue  # rebuilt when read: nothing is stored
                if storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                by[type(fn).__name__, name, tuple(t.shape), str(t.dtype)] += storage.nbytes()
        stack.extend(f for f, _ in fn.next_functions)
    return by


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def malloc_live_bytes() -> int:
    """Bytes glibc's malloc has handed out and not taken back (heap in use + mmapped blocks), from
    ``mallinfo2``; raises OSError / AttributeError where there is no glibc >= 2.33."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd
