"""The registry of architectures: each package registers a :class:`ModelSpec` here; ``create_model`` and the
generic code (Lightning modules, runner, FSDP2, evaluation) look them up."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    name: str  # model.arch in recipes
    config_class: type  # the architecture's config dataclass
    build: Callable[[Any], nn.Module]  # config -> model (LM or classifier)
    presets: dict[str, dict]  # named sizes: config field values
    flops_per_token: Callable[
        [Any, int], float
    ]  # (config, sequence length) -> training FLOPs per token (MFU)
    streaming: str  # how evaluation beyond the training length works, in words (reports say it)


ARCHS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    clash = set(spec.presets) & {p for s in ARCHS.values() for p in s.presets}
    if spec.name in ARCHS or clash:
        raise ValueError(f"architecture {spec.name!r} or presets {sorted(clash)} registered twice")
    ARCHS[spec.name] = spec
    return spec


def get_arch(name: str) -> ModelSpec:
    if name not in ARCHS:
        raise KeyError(f"unknown model.arch {name!r}; registered: {', '.join(sorted(ARCHS))}")
    return ARCHS[name]


def arch_of(config: Any) -> ModelSpec:
    """The spec whose config class ``config`` is."""
    for spec in ARCHS.values():
        if isinstance(config, spec.config_class):
            return spec
    raise TypeError(f"{type(config).__name__} is not the config of a registered architecture")


def build_model(config: Any) -> nn.Module:
    return arch_of(config).build(config)


def list_models() -> list[str]:
    return sorted(p for s in ARCHS.values() for p in s.presets)


def _owner(name: str) -> ModelSpec:
    for spec in ARCHS.values():
        if name in spec.presets:
            return spec
    raise KeyError(f"unknown model preset {name!r}; known presets: {', '.join(list_models())}")


def get_config(name: str, **overrides) -> Any:
    """The preset's configuration with ``overrides`` applied (unknown names and keys are errors)."""
    spec = _owner(name)
    valid = {f.name for f in dataclasses.fields(spec.config_class)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise KeyError(f"unknown {spec.name} config keys {unknown}; valid keys: {', '.join(sorted(valid))}")
    return dataclasses.replace(spec.config_class(**spec.presets[name]), **overrides)


def create_model(name: str, device: str | torch.device | None = None, **overrides) -> nn.Module:
    """Build a registered size. ``device="meta"`` builds without allocating (e.g. the 7B)."""
    cfg = get_config(name, **overrides)
    if device is None:
        return build_model(cfg)
    with torch.device(device):
        return build_model(cfg)


def count_parameters(model: nn.Module) -> int:
    """Parameters counted once (tied weights once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
