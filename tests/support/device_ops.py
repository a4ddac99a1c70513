"""Counting the device operations of a step on the CPU: every aten op that is neither a view nor metadata
only (each is a kernel on a GPU), what runs inside the suite's custom ops, and every Triton kernel launch run in
the interpreter. Used by tests/models/test_device_ops.py and the kernels' own launch-count tests."""

from __future__ import annotations

import collections
import contextlib
import os
import sys

from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")

# Not device work: allocation, resizing and size queries (views are recognised from their schema).
METADATA_ONLY = frozenset(
    "empty empty_like empty_strided new_empty new_empty_strided resize_ set_ _unsafe_view lift_fresh "
    "sym_size sym_stride sym_numel sym_storage_offset is_same_size _has_compatible_shallow_copy_type".split()
)


def is_device_op(func) -> bool:
    """An aten op that runs a kernel on a GPU: not a view or alias (an in-place op's alias is a write, so
    it counts), not metadata only."""
    return not func.is_view and func._schema.name.split("::")[-1] not in METADATA_ONLY


def _source() -> str:
    """Where an op comes from: the innermost frame of the suite's own code (not the tests), else the
    autograd engine (a built-in backward)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(ROOT) and "site-packages" not in path and not path.startswith(TESTS):
            return f"{os.path.relpath(path, ROOT)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "autograd engine"


class DeviceOps(TorchDispatchMode):
    """Counts device operations by name (``ops``) and by source (``sources``)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.sources: collections.Counter = collections.Counter()
        self.in_launch = 0

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def record(self, name: str) -> None:
        self.ops[name] += 1
        self.sources[_source()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_launch:  # the interpreter copying a kernel's arguments: not the kernel's work
            return func(*args, **kwargs)
        if func.namespace == "mega_suite":  # a custom op: count what its implementation does
            from torch._library.custom_ops import OPDEFS

            with self:
                return OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        if is_device_op(func):
            self.record(str(func.overloadpacket))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _setattr(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextlib.contextmanager
def counting_launches(counter: DeviceOps):
    """Each Triton kernel launch counts once (a launch inside a launch does not): interpreted launches on
    CPU tensors, compiled ones (``JITFunction.run``) on a GPU."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def counting(run):
        def counted(self, *args, **kwargs):
            if counter.in_launch:
                return run(self, *args, **kwargs)
            module = self.fn.__module__.removeprefix("kernels.").removesuffix(".triton")
            counter.record(f"triton {module}.{self.fn.__name__}")
            counter.in_launch += 1
            try:
                return run(self, *args, **kwargs)
            finally:
                counter.in_launch -= 1

        return counted

    with (
        _setattr(InterpretedFunction, "run", counting(InterpretedFunction.run)),
        _setattr(JITFunction, "run", counting(JITFunction.run)),
    ):
        yield
