"""Architectures as registered units (torchtitan's per-model packages and model specs, timm's registry).

Each architecture package (``megalodon``, ``llama``) owns its config dataclass, its named sizes, its builder
and its metadata, and registers a :class:`ModelSpec` (``registry.py``). An instance of any registered model answers the
questions generic code asks (``mega_suite.models.common.Backbone``): ``fsdp_units()``,
``float32_modules()``, ``no_weight_decay()``. The Lightning modules, the runner, the FSDP2 code and the
evaluation ask through this registry and the instance; none of them names a Megalodon or Llama module.

Importing this package imports no torch (the registry's rule): a recipe is checked before anything heavy loads.

    create_model("megalodon_7b", device="meta")      # any registered size, any config field overridable
    create_model("llama_200m", share_emb=True)
    list_models(), get_config(name, **overrides), build_model(config)
"""

from __future__ import annotations

from mega_suite.models import llama, megalodon  # registers the architectures
from mega_suite.models.registry import (
    ARCHS,
    ModelSpec,
    arch_of,
    build_model,
    build_on_meta,
    count_parameters,
    create_model,
    get_arch,
    get_config,
    list_models,
    register,
)

__all__ = [
    "ARCHS", "ModelSpec", "arch_of", "build_model", "build_on_meta", "count_parameters", "create_model", "get_arch",
    "get_config", "list_models", "llama", "megalodon", "register",
]  # fmt: skip
