"""Reading a pickle from a user's disk without running code planted in it.

``pickle.load`` calls whatever a file names (``os.system``, ``subprocess.Popen``, ...). Two formats the suite
reads are pickles: the ``.metadata`` of a sharded (torch.distributed.checkpoint) checkpoint and CIFAR-10's
python batches. ``restricted_load`` resolves only the globals its caller allows, so anything else is a
``PickleRefused`` naming the global, before it could be called. Everything else the suite reads from disk is not
a pickle or goes through ``torch.load(weights_only=True)``.

Written here rather than with torch's own weights-only unpickler: that one is private API
(``torch._weights_only_unpickler``) and this module must not import torch (the CIFAR reader runs without it).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import IO, Any


class PickleRefused(pickle.UnpicklingError):
    """A pickle names a global its reader does not allow."""


class _Restricted(pickle.Unpickler):
    def __init__(self, file: IO[bytes], allowed: Callable[[str, str], bool], encoding: str):
        super().__init__(file, encoding=encoding)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if not self._allowed(module, name):
            raise PickleRefused(f"it names {module}.{name}, which this reader does not allow")
        return super().find_class(module, name)


def restricted_load(file: IO[bytes], allowed: Callable[[str, str], bool], encoding: str = "ASCII") -> Any:
    """``pickle.load(file)`` resolving only the globals ``allowed(module, name)`` accepts."""
    return _Restricted(file, allowed, encoding).load()
