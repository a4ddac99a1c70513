"""The registry of architectures: each package registers a :class:`ModelSpec` here; ``create_model`` and the
generic code (Lightning modules, runner, FSDP2, evaluation, export) look them up and never name an
architecture. A third architecture is one package that registers its spec.

A spec and its package's ``__init__`` import no torch: a recipe is checked (``mega_suite.config``) before
anything heavy is imported; ``build``, ``generate`` and ``context_seen`` import their modules when called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    name: str  # model.arch in recipes
    config_class: type  # the architecture's config dataclass
    build: Callable[[Any], Any]  # config -> model (LM or classifier)
    presets: dict[str, dict]  # named sizes: config field values
    flops_per_token: Callable[
        [Any, int], float
    ]  # (config, sequence length) -> training FLOPs per token (MFU)
    streaming: str  # how evaluation beyond the training length works, in words (reports say it)
    # (the recipe's Megalodon config, the data's seq_len or None) -> this architecture's config for the recipe;
    # a ValueError says what the recipe lacks
    from_recipe: Callable[[Any, int | None], Any]
    # the same arguments -> None, or a ValueError naming what the recipe lacks; cheap (no torch): run at load
    check_recipe: Callable[[Any, int | None], None]
    # (model, prompt [B, L], max_new_tokens, **sampling) -> [B, L + new]: the architecture's decoder
    generate: Callable[..., Any]
    # (model, position) -> how many tokens the prediction at ``position`` is computed from
    context_seen: Callable[[Any, int], int]
    # (config) -> how a report says the model sees long contexts
    context_note: Callable[[Any], str]
    compiled_decoder: bool = False  # mode=generate compile=true (a compiled static decoder)
    chunk_parallel: bool = False  # trainer.chunk_parallel > 1 (sequences split across ranks)
    language_model_only: bool = False  # no classifier of this architecture (task=lm only)


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


def build_model(config: Any):
    return arch_of(config).build(config)


# nn.init's random fills: on the meta device they produce nothing but still run, through torch's Python
# reference ops (~15 ms a call: seconds per model, and the first call imports torch._dynamo)
_RANDOM_FILLS = (
    "normal_", "trunc_normal_", "uniform_", "kaiming_normal_", "kaiming_uniform_", "xavier_normal_",
    "xavier_uniform_", "orthogonal_",
)  # fmt: skip


def build_on_meta(config: Any):
    """``config``'s model on the meta device, its random initialisation skipped (as transformers'
    ``no_init_weights``): shapes and parameter counts at no cost. Materialise with ``to_empty`` then
    ``init_weights()``, which initialises every parameter and buffer."""
    import torch

    saved = {name: getattr(torch.nn.init, name) for name in _RANDOM_FILLS}
    try:
        for name in saved:
            setattr(torch.nn.init, name, _unchanged)
        with torch.device("meta"):
            return build_model(config)
    finally:
        for name, fill in saved.items():
            setattr(torch.nn.init, name, fill)


def _unchanged(tensor, *args, **kwargs):
    return tensor


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


def create_model(name: str, device=None, **overrides):
    """Build a registered size. ``device="meta"`` builds without allocating (e.g. the 7B)."""
    import torch

    cfg = get_config(name, **overrides)
    if device is None:
        return build_model(cfg)
    if str(device) == "meta":
        return build_on_meta(cfg)
    with torch.device(device):
        return build_model(cfg)


def count_parameters(model) -> int:
    """Parameters counted once (tied weights once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
