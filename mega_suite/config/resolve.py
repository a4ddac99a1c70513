"""From a validated configuration to what a run builds: the data module and its arguments, the model config,
tokens per sequence, the device count (docs/configuration.md)."""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from datamodules import DATAMODULES
from mega_suite.config.schema import ConfigError
from mega_suite.models import ARCHS, build_model, count_parameters
from mega_suite.models.llama import matched_config
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


def _init_parameters(cls: type) -> dict[str, inspect.Parameter]:
    return {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}


def data_module(cfg: DictConfig) -> tuple[type, dict[str, Any]]:
    """The class registered as ``data.name`` and its keyword arguments; a ConfigError for any key it does not
    take (``data.options`` are checked against its ``__init__`` signature)."""
    d = cfg.data
    if d.name not in DATAMODULES:
        near = difflib.get_close_matches(str(d.name), list(DATAMODULES), n=3)
        raise ConfigError(
            f"data.name={d.name!r} is unknown; nearest: {near}; all: {', '.join(sorted(DATAMODULES))}"
        )
    cls = DATAMODULES[d.name]
    params = _init_parameters(cls)
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = dict(data_dir=d.data_dir, batch_size=d.batch_size, num_workers=d.num_workers)
    kwargs["seed"] = cfg.seed
    for key, unset in (("max_length", None), ("pad_to_multiple", 1)):
        value = d[key]
        if value == unset:
            continue
        if key not in params and not any_keyword:
            raise ConfigError(
                f"data.{key}={value} is not used by data.name={d.name!r} ({cls.__name__} takes no {key}); "
                "remove it from the recipe or the command line"
            )
        kwargs[key] = value
    default_length = getattr(cls, "default_max_length", None)
    if getattr(cls, "input_type", None) == "scalar" and d.max_length not in (None, default_length):
        raise ConfigError(
            f"data.max_length={d.max_length}: data.name={d.name!r} has images of exactly {default_length} "
            f"pixels; set data.max_length={default_length} or leave it out"
        )
    options = OmegaConf.to_container(d.options, resolve=True)
    shared = sorted(set(options) & set(_SHARED_DATA_KEYS))
    if shared:
        raise ConfigError(
            f"data.options.{shared[0]} is set through {_SHARED_DATA_KEYS[shared[0]]}, not data.options"
        )
    unknown = sorted(set(options) - set(params))
    if unknown and not any_keyword:
        valid = sorted(set(params) - set(_SHARED_DATA_KEYS))
        raise ConfigError(
            f"data.options {unknown} are not options of data.name={d.name!r} ({cls.__name__}); valid: {valid}"
        )
    kwargs.update(options)
    return cls, kwargs


@dataclass(frozen=True)
class DataContract:
    """What a data module feeds the model, read from its class attributes (``task``, ``input_type``,
    ``is_retrieval``) and checked against ``task`` and ``model.*`` at load."""

    task: str  # classify | lm
    input_type: str = "token"  # the model.input_type its batches need
    dual_input: bool = False  # batches of document pairs (input1, input2): retrieval


def data_contract(cls: type) -> DataContract:
    task = getattr(cls, "task", None)
    if task not in ("classify", "lm"):
        raise ConfigError(
            f"data module {cls.__name__} declares no task (class attribute task = classify | lm)"
        )
    return DataContract(task, getattr(cls, "input_type", "token"), bool(getattr(cls, "is_retrieval", False)))


def data_option(cfg: DictConfig, name: str, default: Any = None) -> Any:
    """A data module argument as the run will pass it: ``data.options`` or the module's own default."""
    cls, kwargs = data_module(cfg)
    if name in kwargs:
        return kwargs[name]
    param = _init_parameters(cls).get(name)
    if param is None or param.default is inspect.Parameter.empty:
        return default
    return param.default


def data_num_classes(cfg: DictConfig) -> int | None:
    """Class count of a classification data module: its class attribute, else its ``num_classes`` argument."""
    cls, _ = data_module(cfg)
    fixed = getattr(cls, "num_classes", None)
    if isinstance(fixed, int):
        return fixed
    return data_option(cfg, "num_classes")


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


def model_config(cfg: DictConfig, **updates: Any):
    """The model config of a run (``updates`` e.g. the data module's vocab_size / num_classes): the
    MegalodonConfig the model section describes, or with ``model.arch=llama`` the LlamaConfig matched to it in
    parameter count, with the data's ``seq_len`` as its context window."""

    values = OmegaConf.to_container(cfg.model, resolve=True)
    values.pop("preset", None)
    arch = values.pop("arch")
    values.update(updates)
    megalodon = MegalodonConfig(**values)
    if arch not in ARCHS:
        raise ConfigError(
            f"model.arch={arch!r} is not a registered architecture; expected one of {sorted(ARCHS)}"
        )
    if arch == "megalodon":
        return megalodon
    return _llama_config(cfg, megalodon)


def _llama_config(cfg: DictConfig, megalodon: MegalodonConfig):
    import torch

    if cfg.task != "lm" or megalodon.is_classifier:
        raise ConfigError("model.arch=llama is a causal language model: it needs task=lm")
    if megalodon.adaptive_cutoffs:
        raise ConfigError(
            "model.arch=llama has no adaptive input / softmax (model.adaptive_cutoffs, WikiText-103): use "
            "model.arch=megalodon for this recipe"
        )
    seq_len = data_option(cfg, "seq_len")
    if not seq_len:
        raise ConfigError("model.arch=llama needs the data's seq_len (data.options.seq_len) as its window")
    with torch.device("meta"):
        target = count_parameters(build_model(megalodon))
    return matched_config(
        target, megalodon.model_dim, megalodon.vocab_size, megalodon.share_emb, max_seq_len=int(seq_len),
        norm_eps=megalodon.norm_eps, dropout=megalodon.dropout,
    )  # fmt: skip


def device_count(cfg: DictConfig) -> int:
    devices = cfg.trainer.devices
    if isinstance(devices, int):
        return devices
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if str(devices) == "auto" and cfg.trainer.accelerator != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def accumulation(cfg: DictConfig) -> int:
    """trainer.global_batch_tokens -> round(target / (batch x mean tokens per sequence x devices x nodes)), at
    least 1 (the paper's 4M-token batch of the 7B run; WikiText-103's 6144 x 24); else the key as set."""
    target = cfg.trainer.global_batch_tokens
    if target <= 0:
        return int(cfg.trainer.accumulate_grad_batches)
    per_step = cfg.data.batch_size * tokens_per_sequence(cfg) * device_count(cfg) * cfg.trainer.num_nodes
    return max(1, round(target / per_step))
