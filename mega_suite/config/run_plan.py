"""The configuration resolved once into what a run builds (docs/configuration.md#recipes): the data module and
its arguments, the model config, tokens per sequence, devices and gradient accumulation. The runner,
``mode=plan`` and the Lightning modules' arguments come from a ``RunPlan``, not from keys re-derived where
each is needed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import lightning as L
from omegaconf import DictConfig

from mega_suite.config.resolve import (
    accumulation,
    data_module,
    data_option,
    device_count,
    model_config,
    tokens_per_sequence,
)
from mega_suite.models import arch_of

SHARDING_STRATEGIES = ("fsdp", "hsdp")  # built on the meta device, sharded, then initialised


@dataclass(frozen=True)
class RunPlan:
    cfg: DictConfig  # the validated configuration this plan was resolved from
    data_class: type  # the data module registered as data.name
    data_kwargs: dict[str, Any]  # its keyword arguments (data.*, data.options, the seed)
    model: Any  # MegalodonConfig | LlamaConfig; vocab_size / num_classes from the data once it is prepared
    devices: int  # per node
    nodes: int
    sharded: bool  # trainer.strategy fsdp / hsdp
    tokens_per_sequence: float  # mean training tokens per sequence (language models; 0 for classifiers)
    seq_len: int  # the data's seq_len (language models with fixed-length sequences; else 0)
    accumulate_grad_batches: int  # as set, or derived from trainer.global_batch_tokens
    label_smoothing: float  # classifiers: the data module's (DeiT's 0.1 for ImageNet)

    @property
    def world(self) -> int:
        return self.devices * self.nodes

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token of the model (language models; 0 otherwise): what MFU is counted from."""
        if self.cfg.task != "lm":
            return 0.0
        return arch_of(self.model).flops_per_token(self.model, self.seq_len)

    def build_data(self) -> L.LightningDataModule:
        return self.data_class(**self.data_kwargs)

    def with_data(self, dm: Any) -> RunPlan:
        """The plan with the model's vocabulary size and class count taken from the prepared data module."""
        updates = {}
        if getattr(dm, "vocab_size", None):
            updates["vocab_size"] = int(dm.vocab_size)
        if self.cfg.task == "classify" and getattr(dm, "num_classes", None):
            updates["num_classes"] = int(dm.num_classes)
        return dataclasses.replace(self, model=model_config(self.cfg, **updates)) if updates else self

    def global_batch_line(self) -> str | None:
        """How ``trainer.global_batch_tokens`` became an accumulation, for the log (None when unset)."""
        target = self.cfg.trainer.global_batch_tokens
        if target <= 0:
            return None
        per_step = self.cfg.data.batch_size * self.tokens_per_sequence * self.world
        return (
            f"global batch {target} tokens = {per_step:g} tokens per step x {self.accumulate_grad_batches} "
            f"accumulation ({per_step * self.accumulate_grad_batches:g} tokens)"
        )


def resolve_plan(cfg: DictConfig) -> RunPlan:
    """The plan of a configuration ``load_config`` validated."""
    data_class, data_kwargs = data_module(cfg)
    lm = cfg.task == "lm"
    return RunPlan(
        cfg=cfg,
        data_class=data_class,
        data_kwargs=data_kwargs,
        model=model_config(cfg),
        devices=device_count(cfg),
        nodes=int(cfg.trainer.num_nodes),
        sharded=cfg.trainer.strategy in SHARDING_STRATEGIES,
        tokens_per_sequence=tokens_per_sequence(cfg) if lm else 0.0,
        seq_len=int(data_option(cfg, "seq_len", 0) or 0) if lm else 0,
        accumulate_grad_batches=accumulation(cfg),
        label_smoothing=0.0 if lm else float(data_option(cfg, "label_smoothing", 0.0)),
    )
