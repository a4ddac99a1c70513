"""Experiment configuration: typed omegaconf structured configs, recipes with inheritance, dotted overrides.

Resolution order (later wins): dataclass defaults < the model preset named by ``model.preset`` < the
recipe chain (``inherit:`` parents first) < command-line ``key=value`` overrides. A misspelt key or a
value of the wrong type fails at once, naming the key, the value and the nearest valid keys.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.models.megalodon.presets import PRESETS

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


@dataclass
class ModelSection(MegalodonConfig):
    preset: str = "megalodon_debug"  # registry name (mega_suite.models); its values are the defaults here

    def __post_init__(self) -> None:  # validated when the model is built, after all overrides
        pass


@dataclass
class DataSection:
    name: str = "listops"  # datamodule registry name (datamodules.DATAMODULES)
    data_dir: str = "data"  # root of the published on-disk layout
    batch_size: int = 64  # per device
    num_workers: int = 0  # DataLoader workers
    max_length: int = 2000  # truncation length (tokens, pixels, samples)
    pad_to_multiple: int = 1  # collation pads the batch length to a multiple of this
    options: dict[str, Any] = field(default_factory=dict)  # task-specific datamodule keyword arguments


@dataclass
class OptimSection:
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    schedule: str = "linear"  # linear | cosine | constant (after warmup)
    warmup_steps: int = 0  # linear warmup from 0
    min_lr_ratio: float = 0.0  # final lr as a fraction of the peak
    clip_grad_norm: float = 1.0  # 0 disables clipping
    no_decay_groups: bool = False  # exempt norms, biases, CEMA parameters and embeddings from decay


@dataclass
class TrainerSection:
    max_steps: int = 1000  # optimizer steps
    max_epochs: int = -1  # -1: bounded by max_steps only
    accelerator: str = "auto"  # auto | cpu | gpu
    devices: Any = "auto"  # number of devices or "auto"
    num_nodes: int = 1
    strategy: str = "auto"  # auto | ddp | fsdp
    precision: str = "32-true"  # 32-true | bf16-mixed | 64-true
    accumulate_grad_batches: int = 1
    global_batch_tokens: int = (
        0  # > 0: set accumulate_grad_batches = this / (batch * seq_len * devices * nodes)
    )
    peak_tflops: float = 0.0  # per-device peak for MFU logging (e.g. 989 for H100 bf16 dense); 0: no MFU
    val_check_interval: int = 500  # validate (and test) every N training batches
    limit_val_batches: float = 1.0  # fraction (<= 1.0) or number of batches
    limit_test_batches: float = 1.0
    log_every_n_steps: int = 10
    gradient_checkpointing: bool = False  # recompute block activations in backward
    compile: bool = False  # torch.compile the model
    deterministic: bool = False
    progress_bar: bool = True


@dataclass
class RunConfig:
    recipe: str = "debug"  # recipe name (recipes/<name>.yaml)
    description: str = ""  # one line shown by `python run.py recipe=list`
    task: str = "classify"  # classify | lm
    mode: str = "fit"  # fit | validate | test | eval_context
    seed: int = 1234
    run_root: str = "runs"  # runs/<recipe>/<timestamp>/
    run_dir: str | None = None  # set to reuse a directory
    resume: str | None = None  # auto | path to a .ckpt or a run directory
    ckpt: str | None = None  # checkpoint for validate / test
    init_from: str | None = None  # fit: start from this checkpoint's model weights (new optimizer, step 0)
    eval_context_lengths: list[int] = field(
        default_factory=list
    )  # mode=eval_context; empty: 4K, 8K, ... longest
    eval_max_documents: int = 0  # mode=eval_context: 0 = every validation document
    monitor: str = "val/acc"  # metric for the best checkpoint
    monitor_mode: str = "max"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)


class ConfigError(ValueError):
    """A recipe or override a user wrote is wrong; the message says what and how to fix it."""


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
    _validate(cfg)
    return cfg


_CHOICES = {
    "task": ("classify", "lm"),
    "mode": ("fit", "validate", "test", "eval_context"),
    "monitor_mode": ("max", "min"),
    "optim.schedule": ("linear", "cosine", "constant"),
    "trainer.strategy": ("auto", "ddp", "fsdp"),
    "trainer.precision": ("32-true", "32", "bf16-mixed", "bf16-true", "64-true", "64"),
}


def _validate(cfg: DictConfig) -> None:
    for key, choices in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is invalid; expected one of {', '.join(map(str, choices))}")
    for key in ("data.batch_size", "trainer.max_steps", "trainer.accumulate_grad_batches"):
        value = OmegaConf.select(cfg, key)
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be > 0")
    try:
        model_config(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def model_config(cfg: DictConfig, **updates: Any) -> MegalodonConfig:
    """The MegalodonConfig of a run (``updates`` e.g. the data module's vocab_size / num_classes)."""
    values = OmegaConf.to_container(cfg.model, resolve=True)
    values.pop("preset", None)
    values.update(updates)
    return MegalodonConfig(**values)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
