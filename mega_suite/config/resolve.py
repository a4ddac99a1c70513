"""From a validated configuration to what a run builds: the data module and its arguments, the model config,
tokens per sequence and per step, the device count (docs/configuration.md).

Everything here reads the data modules' contracts (``datamodules.contracts``) rather than the modules
themselves, and imports no torch at import time: ``data_module`` imports the data module's class, and
``model_config`` of a Llama and ``device_count`` of ``devices=auto`` import torch, when called.
"""

from __future__ import annotations

import difflib
from typing import Any

from omegaconf import DictConfig, OmegaConf

from datamodules.contracts import CONTRACTS, DataContract
from mega_suite.config.schema import ConfigError
from mega_suite.models import ARCHS
from mega_suite.models.megalodon.config import MegalodonConfig

# Keyword arguments every data module takes, from data.* and the run's seed (never through data.options).
_SHARED_DATA_KEYS = dict(
    data_dir="data.data_dir",
    batch_size="data.batch_size",
    num_workers="data.num_workers",
    seed="seed",
    max_length="data.max_length",
    pad_to_multiple="data.pad_to_multiple",
)


def data_contract(cfg_or_name: DictConfig | str) -> DataContract:
    """The contract of ``data.name``; a ConfigError with the nearest names for an unknown one."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else cfg_or_name.data.name
    if name not in CONTRACTS:
        near = difflib.get_close_matches(str(name), list(CONTRACTS), n=3)
        raise ConfigError(
            f"data.name={name!r} is unknown; nearest: {near}; all: {', '.join(sorted(CONTRACTS))}"
        )
    return CONTRACTS[name]


def data_arguments(cfg: DictConfig) -> dict[str, Any]:
    """The data module's keyword arguments (data.*, data.options, the seed), each checked against its
    declared option: an undeclared option, a value of the wrong type or out of range is a ConfigError."""
    d = cfg.data
    contract = data_contract(cfg)
    cls = contract.target.partition(":")[2]
    kwargs: dict[str, Any] = dict(data_dir=d.data_dir, batch_size=d.batch_size, num_workers=d.num_workers)
    kwargs["seed"] = cfg.seed
    for key, unset in (("max_length", None), ("pad_to_multiple", 1)):
        value = d[key]
        if value == unset:
            continue
        if not contract.takes_length:
            raise ConfigError(
                f"data.{key}={value} is not used by data.name={d.name!r} ({cls} takes no {key}); "
                "remove it from the recipe or the command line"
            )
        kwargs[key] = value
    if contract.fixed_length and d.max_length not in (None, contract.default_max_length):
        raise ConfigError(
            f"data.max_length={d.max_length}: data.name={d.name!r} has images of exactly "
            f"{contract.default_max_length} pixels; set data.max_length={contract.default_max_length} or leave it out"
        )
    options = OmegaConf.to_container(d.options, resolve=True)
    shared = sorted(set(options) & set(_SHARED_DATA_KEYS))
    if shared:
        raise ConfigError(
            f"data.options.{shared[0]} is set through {_SHARED_DATA_KEYS[shared[0]]}, not data.options"
        )
    unknown = sorted(set(options) - set(contract.options))
    if unknown:
        raise ConfigError(
            f"data.options {unknown} are not options of data.name={d.name!r} ({cls}); valid: {sorted(contract.options)}"
        )
    for key, value in options.items():
        problem = contract.options[key].problem(value)
        if problem is not None:
            raise ConfigError(
                f"data.options.{key}={value!r} is invalid for data.name={d.name!r}; expected {problem}"
            )
    kwargs.update(options)
    return kwargs


def data_module(cfg: DictConfig) -> tuple[type, dict[str, Any]]:
    """The class registered as ``data.name`` (imported here) and its checked keyword arguments."""
    from datamodules import DATAMODULES

    kwargs = data_arguments(cfg)
    return DATAMODULES[cfg.data.name], kwargs


def data_option(cfg: DictConfig, name: str, default: Any = None) -> Any:
    """A data module argument as the run will pass it: ``data.options`` or the module's declared default."""
    options = cfg.data.options
    if name in options:
        return options[name]
    option = data_contract(cfg).options.get(name)
    return default if option is None or option.default is None else option.default


def data_num_classes(cfg: DictConfig) -> int | None:
    """Class count of a classification data module: its fixed count, else its ``num_classes`` option."""
    fixed = data_contract(cfg).num_classes
    return fixed if fixed is not None else data_option(cfg, "num_classes")


def tokens_per_sequence(cfg: DictConfig) -> float:
    """Mean training tokens per sequence: ``chunk_size * (min_chunks + max_chunks) / 2`` for variable-length
    batches of ``k ~ U{min_chunks..max_chunks}`` chunks (WikiText-103), else ``seq_len``."""
    low, high = data_option(cfg, "min_chunks"), data_option(cfg, "max_chunks")
    chunk = data_option(cfg, "chunk_size")
    if low is not None and high is not None and chunk:
        return chunk * (low + high) / 2
    seq_len = data_option(cfg, "seq_len")
    if not seq_len:
        raise ConfigError(
            f"trainer.global_batch_tokens={cfg.trainer.global_batch_tokens}: data.name={cfg.data.name!r} has no "
            "seq_len to count tokens per sequence"
        )
    return float(seq_len)


def megalodon_config(cfg: DictConfig, **updates: Any) -> MegalodonConfig:
    """The Megalodon the model section describes (every architecture is derived from it)."""
    values = OmegaConf.to_container(cfg.model, resolve=True)
    values.pop("preset", None)
    values.pop("arch")
    values.update(updates)
    try:
        return MegalodonConfig(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def model_config(cfg: DictConfig, **updates: Any):
    """The model config of a run (``updates`` e.g. the data module's vocab_size / num_classes): the
    architecture ``model.arch`` names, built by its spec from the Megalodon the model section describes (a
    Llama is matched to it in parameter count, its window the data's ``seq_len``)."""
    arch = cfg.model.arch
    if arch not in ARCHS:
        raise ConfigError(
            f"model.arch={arch!r} is not a registered architecture; expected one of {sorted(ARCHS)}"
        )
    megalodon = megalodon_config(cfg, **updates)
    seq_len = data_option(cfg, "seq_len") if cfg.task == "lm" else None
    try:
        return ARCHS[arch].from_recipe(megalodon, int(seq_len) if seq_len else None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def device_count(cfg: DictConfig) -> int:
    devices = cfg.trainer.devices
    if isinstance(devices, int):
        return devices
    if OmegaConf.is_list(devices) or isinstance(devices, (list, tuple)):
        return len(devices)
    if str(devices) == "auto" and cfg.trainer.accelerator != "cpu":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    return 1


def accumulation(cfg: DictConfig, devices: int | None = None) -> int:
    """trainer.global_batch_tokens -> round(target / (batch x mean tokens per sequence x devices x nodes)), at
    least 1 (the paper's 4M-token batch of the 7B run; WikiText-103's 6144 x 24); else the key as set."""
    target = cfg.trainer.global_batch_tokens
    if target <= 0:
        return int(cfg.trainer.accumulate_grad_batches)
    devices = device_count(cfg) if devices is None else devices
    per_step = cfg.data.batch_size * tokens_per_sequence(cfg) * devices * cfg.trainer.num_nodes
    return max(1, round(target / per_step))


def tokens_per_step(cfg: DictConfig, devices: int | None = None) -> tuple[float, str] | None:
    """Training tokens per optimizer step, and how they were counted: batch x tokens per sequence x devices x
    nodes x accumulation, the one formula of the log's global batch, compare's x-axis and lm_eval's curve.
    Tokens per sequence: a language model's mean (``tokens_per_sequence``); a classifier's ``data.max_length``
    (an upper bound of padded batches). None when the data says no length."""
    devices = device_count(cfg) if devices is None else devices
    if cfg.task == "lm":
        try:
            per_sequence, what = tokens_per_sequence(cfg), "tokens per sequence"
        except ConfigError:
            return None
    else:
        length = cfg.data.max_length or data_contract(cfg).default_max_length
        if not length:
            return None
        per_sequence, what = float(length), "max_length (upper bound)"
    accumulate = accumulation(cfg, devices)
    total = cfg.data.batch_size * per_sequence * devices * cfg.trainer.num_nodes * accumulate
    how = (
        f"{total:g} tokens/step = batch {cfg.data.batch_size} x {what} {per_sequence:g} x accumulate "
        f"{accumulate} x devices {devices} x nodes {cfg.trainer.num_nodes}"
    )
    return total, how
