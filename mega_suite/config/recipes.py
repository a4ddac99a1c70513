"""Recipes with inheritance and dotted overrides, resolved into a typed, validated configuration.

Resolution order (later wins): dataclass defaults < the model preset named by ``model.preset`` < the
recipe chain (``inherit:`` parents first) < command-line ``key=value`` overrides. A misspelt key or a
value of the wrong type fails at once, naming the key, the value and the nearest valid keys.
"""

from __future__ import annotations

import difflib
from dataclasses import fields
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from mega_suite.config.checks import validate
from mega_suite.config.schema import (
    ConfigError,
    DataSection,
    ModelSection,
    OptimSection,
    RunConfig,
    TrainerSection,
)
from mega_suite.models.megalodon.presets import PRESETS

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


def list_recipes() -> dict[str, str]:
    """Recipe name -> one-line description."""
    out = {}
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        if path.stem.startswith("_"):
            continue
        out[path.stem] = str(_recipe_chain(path.stem).get("description", ""))
    return out


def _read_recipe(name: str) -> DictConfig:
    path = RECIPES_DIR / f"{name}.yaml"
    if not path.exists():
        known = [p.stem for p in RECIPES_DIR.glob("*.yaml")]
        near = difflib.get_close_matches(name, known, n=3)
        raise ConfigError(
            f"unknown recipe {name!r} (no {path}); nearest: {near or 'none'}; `python run.py recipe=list` lists all"
        )
    return OmegaConf.load(path)


def _recipe_chain(name: str, seen: tuple[str, ...] = ()) -> DictConfig:
    """The recipe merged over its ``inherit:`` parents."""
    if name in seen:
        raise ConfigError(f"recipe inheritance cycle: {' -> '.join(seen + (name,))}")
    node = _read_recipe(name)
    parent = node.pop("inherit", None)
    if parent is None:
        return node
    return OmegaConf.merge(_recipe_chain(str(parent), seen + (name,)), node)


def _valid_keys() -> list[str]:
    keys = [f.name for f in fields(RunConfig)]
    sections = (
        ("model", ModelSection),
        ("data", DataSection),
        ("optim", OptimSection),
        ("trainer", TrainerSection),
    )
    for name, cls in sections:
        keys += [f"{name}.{f.name}" for f in fields(cls)]
    return keys


def _explain(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
    value = getattr(exc, "value", None)
    valid = _valid_keys()
    near = difflib.get_close_matches(str(key), valid, n=3, cutoff=0.5)
    kind = "unknown key" if isinstance(exc, ConfigKeyError) else "invalid value"
    msg = f"{source}: {kind} {key!r}"
    if value is not None:
        msg += f" = {value!r}"
    msg += f" ({exc.msg.splitlines()[0] if hasattr(exc, 'msg') and exc.msg else exc})"
    if near and isinstance(exc, ConfigKeyError):
        msg += f"; nearest valid keys: {', '.join(near)}"
    return ConfigError(msg)


def _merge(base: DictConfig, other: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as exc:
        raise _explain(exc, source) from None


def load_config(overrides: list[str]) -> DictConfig:
    """Resolve ``recipe=NAME key=value ...`` into a typed, validated configuration."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must be key=value, got {bad}")
    try:
        cli = OmegaConf.from_dotlist(overrides)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides {overrides}: {exc}") from None
    recipe_name = str(cli.get("recipe", "debug"))
    recipe = _recipe_chain(recipe_name)
    recipe["recipe"] = recipe_name
    preset = (
        OmegaConf.select(cli, "model.preset") or OmegaConf.select(recipe, "model.preset") or "megalodon_debug"
    )
    if preset not in PRESETS:
        near = difflib.get_close_matches(str(preset), list(PRESETS), n=3)
        raise ConfigError(
            f"unknown model.preset {preset!r}; nearest: {near}; all: {', '.join(sorted(PRESETS))}"
        )
    cfg = OmegaConf.structured(RunConfig)
    cfg = _merge(cfg, OmegaConf.create({"model": dict(PRESETS[preset], preset=preset)}), f"preset {preset}")
    cfg = _merge(cfg, recipe, f"recipe {recipe_name}")
    cfg = _merge(cfg, cli, "command line")
    OmegaConf.set_readonly(cfg, False)
    # A preset's class count is a placeholder (as its vocab_size): the data's replaces it, a user's must match.
    user_classes = OmegaConf.select(cli, "model.num_classes", default=None)
    if user_classes is None:
        user_classes = OmegaConf.select(recipe, "model.num_classes", default=None)
    validate(cfg, user_classes)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
