"""mega-suite: Megalodon (and a Llama baseline), configurations and Lightning glue.

The names below are imported on first use (PEP 562), so that ``import mega_suite.tools.malloc`` (run.py's first
step, before the process may restart with another allocator) does not import torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LlamaConfig": "mega_suite.models.llama",
    "LlamaLM": "mega_suite.models.llama",
    "MegalodonClassifier": "mega_suite.models.megalodon",
    "MegalodonConfig": "mega_suite.models.megalodon",
    "MegalodonLM": "mega_suite.models.megalodon",
    "build_model": "mega_suite.models",
    "count_parameters": "mega_suite.models",
    "create_model": "mega_suite.models",
    "from_pretrained": "mega_suite.models.bundle",
    "get_config": "mega_suite.models",
    "list_models": "mega_suite.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    try:  # a submodule reached as an attribute (``mega_suite.models``) before anything imported it
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
