"""LightningDataModules of the suite, by name: readers of published on-disk layouts (see docs/data.md).

Importing this package imports no torch or Lightning: ``DATAMODULES[name]`` imports the data module's file
on first use, and ``contracts.CONTRACTS`` declares what each one feeds the model and the options it takes, so
that a recipe is checked before anything heavy is imported."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from .contracts import CONTRACTS
from .errors import DataError as DataError


class _Registry(Mapping):
    """name -> data module class, imported on first access."""

    def __getitem__(self, name: str) -> type:
        module, _, cls = CONTRACTS[name].target.partition(":")
        return getattr(importlib.import_module(module), cls)

    def __iter__(self) -> Iterator[str]:
        return iter(CONTRACTS)

    def __len__(self) -> int:
        return len(CONTRACTS)


DATAMODULES: Mapping[str, type] = _Registry()
_CLASSES = {c.target.partition(":")[2]: name for name, c in CONTRACTS.items()}


def __getattr__(name: str):
    if name in _CLASSES:
        return DATAMODULES[_CLASSES[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_datamodule(name: str, **kwargs):
    """Instantiate the datamodule registered as ``name`` with keyword arguments ``kwargs``."""
    if name not in DATAMODULES:
        raise KeyError(f"unknown datamodule {name!r}; valid names: {', '.join(sorted(DATAMODULES))}")
    return DATAMODULES[name](**kwargs)
