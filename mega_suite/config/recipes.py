"""Recipes with inheritance and dotted overrides, resolved into a typed, validated configuration.

Resolution order (later wins): dataclass defaults < the model preset named by ``model.preset`` < the
recipe chain (``inherit:`` parents first) < command-line ``key=value`` overrides. A misspelt key or a
value of the wrong type fails at once, naming the key, the value and the nearest valid keys.

What a command line says is taken as a user means it (docs/configuration.md#overrides):

- a text key (``prompt``, paths, names: every key the schema types as text, and the text options a data
  module declares) keeps its value verbatim: ``prompt=yes`` is "yes", ``prompt="Note: [x]"`` is that text, and
  ``${...}`` inside it is not an interpolation;
- other values are read as YAML (numbers, booleans, lists); ``lm_eval.tasks=a,b`` and ``lm_eval.tasks=a`` are
  lists of names;
- interpolations (``${oc.env:HOME}``) are resolved once here, and an unresolvable one is one error line;
- ``~`` in a path is the user's home;
- ``recipe=NAME`` is the file NAME.yaml in ``recipes/`` (a name cannot climb out of it); ``recipe=PATH.yaml``
  reads that file, and the run still goes under ``run_root/<its name>``.

Nothing here imports torch: a mistake is reported within a moment of Python's start-up.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from mega_suite.config.checks import validate
from mega_suite.config.schema import (
    PATH_KEYS,
    ConfigError,
    RunConfig,
)
from mega_suite.models.megalodon.presets import PRESETS

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def list_recipes() -> dict[str, str]:
    """Recipe name -> one-line description."""
    out = {}
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        if path.stem.startswith("_"):
            continue
        out[path.stem] = str(_recipe_chain(path.stem).get("description", ""))
    return out


def recipe_file(value: str) -> tuple[str, Path]:
    """``recipe=`` -> (the recipe's name, its file): a bare name in ``recipes/``, or a YAML file by path."""
    if value.endswith((".yaml", ".yml")) or "/" in value or os.sep in value:
        path = Path(os.path.expanduser(value))
        if path.suffix not in (".yaml", ".yml"):
            raise ConfigError(
                f"recipe={value}: a recipe is a name in {RECIPES_DIR} or a path to a .yaml file"
            )
        if not path.is_file():
            raise ConfigError(
                f"recipe={value}: no such recipe file (a recipe is a name in {RECIPES_DIR} or a .yaml file)"
            )
        if not _NAME.match(path.stem):
            raise ConfigError(
                f"recipe={value}: its name {path.stem!r} cannot name a run folder (letters, digits, _ . -)"
            )
        return path.stem, path
    if not _NAME.match(value):
        raise ConfigError(
            f"recipe={value!r} is not a recipe name (letters, digits, _ . -; or a path to a .yaml file)"
        )
    path = RECIPES_DIR / f"{value}.yaml"
    if not path.is_file():
        known = [p.stem for p in RECIPES_DIR.glob("*.yaml") if not p.stem.startswith("_")]
        near = difflib.get_close_matches(value, known, n=3)
        raise ConfigError(
            f"unknown recipe {value!r} (no {path}); nearest: {near or 'none'}; `python run.py recipe=list` lists all"
        )
    return value, path


def _read(path: Path, source: str) -> DictConfig:
    try:
        node = OmegaConf.load(path)
    except (OmegaConfBaseException, ValueError, OSError) as exc:  # YAML syntax, tags, unreadable
        raise ConfigError(f"{source}: cannot read {path} ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{source}: {path} is not a mapping of keys to values")
    return node


def _recipe_chain(name: str, seen: tuple[str, ...] = (), path: Path | None = None) -> DictConfig:
    """The recipe merged over its ``inherit:`` parents (named in ``recipes/``)."""
    if name in seen:
        raise ConfigError(f"recipe inheritance cycle: {' -> '.join(seen + (name,))}")
    if path is None:
        name, path = recipe_file(name)
    node = _read(path, f"recipe {name}")
    parent = node.pop("inherit", None)
    if parent is None:
        return node
    return OmegaConf.merge(_recipe_chain(str(parent), seen + (name,)), node)


# ---------------------------------------------------------------------------------------------- overrides


def _field_types() -> dict[str, str]:
    """Every schema key (``section.key``) -> its annotation as written (``str | None``, ``list[str]``, ...)."""
    out = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            else:
                out[prefix + f.name] = str(f.type)

    walk(RunConfig, "")
    return out


_TYPES = _field_types()
_TEXT = {k for k, t in _TYPES.items() if t.replace(" ", "") in ("str", "str|None")}
_TEXT_LISTS = {k for k, t in _TYPES.items() if t.replace(" ", "") == "list[str]"}


def _text_option(data_name: str | None, key: str) -> bool:
    from datamodules.contracts import CONTRACTS

    contract = CONTRACTS.get(data_name or "")
    option = contract.options.get(key.removeprefix("data.options.")) if contract else None
    return option is not None and option.kind in ("str", "path")


def _escape(text: str) -> str:
    """``text`` as OmegaConf keeps it literally: ``${`` is escaped, and so are the backslashes before one
    (elsewhere a backslash is literal)."""
    return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)


def _yaml_value(key: str, value: str):
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value}"]))["v"]
    except (OmegaConfBaseException, ValueError, TypeError) as exc:  # bad YAML, an unknown or failing !!tag
        raise ConfigError(
            f"{key}={value}: cannot be read as a value ({' '.join(str(exc).split())[:160]})"
        ) from None


def parse_overrides(overrides: list[str], data_name: str | None) -> DictConfig:
    """``key=value`` items -> a nested config, text keys verbatim (see the module docstring)."""
    tree: dict = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not _KEY.match(key):
            raise ConfigError(f"overrides are key=value with a dotted key, got {item!r}")
        if key in _TEXT or (key.startswith("data.options.") and _text_option(data_name, key)):
            node = _escape(value)
        elif key in _TEXT_LISTS and not value.lstrip().startswith("["):
            parts = [v.strip() for v in value.split(",")] if key == "lm_eval.tasks" else [value]
            node = [_escape(p) for p in parts if p]
        else:
            node = _yaml_value(key, value)
        where = tree
        *parents, last = key.split(".")
        for part in parents:
            where = where.setdefault(part, {})
            if not isinstance(where, dict):
                raise ConfigError(f"{item!r}: {part} is set to a value and also used as a section")
        where[last] = node
    return OmegaConf.create(tree)


def _valid_keys() -> list[str]:
    return sorted(_TYPES)


def _explain(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = _short(getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?")
    value = getattr(exc, "value", None)
    value = _short(value) if isinstance(value, str) else value
    near = difflib.get_close_matches(str(key), _valid_keys(), n=3, cutoff=0.5)
    kind = "unknown key" if isinstance(exc, ConfigKeyError) else "invalid value"
    msg = f"{source}: {kind} {key!r}"
    if value is not None:
        msg += f" = {value!r}"
    msg += f" ({_short(exc.msg.splitlines()[0] if hasattr(exc, 'msg') and exc.msg else str(exc))})"
    if near and isinstance(exc, ConfigKeyError):
        msg += f"; nearest valid keys: {', '.join(near)}"
    return ConfigError(msg)


def _short(text, most: int = 120) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= most else text[: most - 3] + "..."


def _merge(base: DictConfig, other: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as exc:
        raise _explain(exc, source) from None


def _resolved(cfg: DictConfig) -> DictConfig:
    """The configuration with every interpolation resolved once, now (an unresolvable one is one error naming
    its key), rebuilt with every text escaped: no value of the result is an interpolation any more, also when
    its YAML is read back."""
    try:
        plain = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        reason = " ".join(str(exc).split("\n")[0].split())
        raise ConfigError(f"{key}: cannot resolve its interpolation ({reason})") from None

    def escaped(node):
        if isinstance(node, str):
            return _escape(node)
        if isinstance(node, dict):
            return {k: escaped(v) for k, v in node.items()}
        if isinstance(node, list):
            return [escaped(v) for v in node]
        return node

    return _merge(
        OmegaConf.structured(RunConfig), OmegaConf.create(escaped(plain)), "the resolved configuration"
    )


def _expand_paths(cfg: DictConfig) -> None:
    for key in PATH_KEYS:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, str) and value.startswith("~"):
            OmegaConf.update(cfg, key, _escape(os.path.expanduser(value)), merge=False)
        elif OmegaConf.is_list(value):
            items = [_escape(os.path.expanduser(v)) if isinstance(v, str) else v for v in value]
            OmegaConf.update(cfg, key, items, merge=False)
    options = cfg.data.options
    for key in list(options):
        if (
            isinstance(options[key], str)
            and options[key].startswith("~")
            and _text_option(cfg.data.name, key)
        ):
            options[key] = _escape(os.path.expanduser(options[key]))


def load_config(overrides: list[str]) -> DictConfig:
    """Resolve ``recipe=NAME key=value ...`` into a typed, validated configuration (no file is read but the
    recipes; ``mega_suite.config.run_plan`` checks the files a run names)."""
    recipe_value = next((o.partition("=")[2] for o in overrides if o.startswith("recipe=")), "debug")
    recipe_name, recipe_path = recipe_file(recipe_value)
    recipe = _recipe_chain(recipe_name, path=recipe_path)
    data_name = next((o.partition("=")[2] for o in overrides if o.startswith("data.name=")), None)
    cli = parse_overrides(
        [o for o in overrides if not o.startswith("recipe=")],
        data_name or OmegaConf.select(recipe, "data.name"),
    )
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
    cfg = _resolved(cfg)
    OmegaConf.set_readonly(cfg, False)
    _expand_paths(cfg)
    # A preset's class count is a placeholder (as its vocab_size): the data's replaces it, a user's must match.
    user_classes = OmegaConf.select(cli, "model.num_classes", default=None)
    if user_classes is None:
        user_classes = OmegaConf.select(recipe, "model.num_classes", default=None)
    validate(cfg, user_classes)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    """The configuration as YAML that loads back to the same values (texts stay escaped: a ``${`` in a prompt
    is not an interpolation when the run's config.yaml is read again)."""
    return OmegaConf.to_yaml(cfg, resolve=False)
