"""LightningModules around any registered architecture (``mega_suite.models``): sequence classification and
causal language modelling.

Both share the optimiser (AdamW, optional no-decay groups), the warmup + linear/cosine schedule, gradient
clipping with gradient-norm logging, the non-finite-loss guard and FSDP2 sharding (``configure_model``).
Validation runs on two loaders, [val, test], so the test metric at the best validation step is readable.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import Tensor, nn

from mega_suite.config import ADAMW_KERNELS, CUDAGRAPH_MODES
from mega_suite.distributed.chunk_parallel import attach, global_mean_loss, slice_batch, slice_bounds
from mega_suite.distributed.fsdp import apply_fsdp, data_parallel_mesh, materialize, uses_model_parallel
from mega_suite.models import build_on_meta
from mega_suite.storage.checkpoints import load_full_weights
from mega_suite.training.saving import NonFiniteLossError

__all__ = ["CausalLM", "NonFiniteLossError", "SequenceClassifier", "SuiteModule", "build_module", "lr_lambda"]

# Inductor options of ``trainer.compile`` on the CPU: a buffer read by several kernels is materialised once
# rather than recomputed inside each (with the default, the compiled backward fused the attention's key /
# value gradients and the RoPE backward into one scalar loop; bench/RESULTS.md, CPU training). Not used on GPUs.
CPU_INDUCTOR_OPTIONS = {"realize_reads_threshold": 1}
STAGES = ("val", "test")


def lr_lambda(schedule: str, warmup: int, total: int, min_ratio: float):
    """Multiplier of the peak lr at optimizer step s: linear warmup, then linear / cosine decay / constant."""

    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return min_ratio + (1 - min_ratio) * (1 - progress)

    return f


class SuiteModule(L.LightningModule):
    """Shared optimisation, logging and sharding."""

    def __init__(
        self,
        model_cfg: Any,  # the config dataclass of a registered architecture
        optim: dict,
        trainer: dict,
        total_steps: int,
        meta_init: bool = False,
        init_seed: int | None = None,
    ):
        super().__init__()
        self.model_cfg, self.optim_cfg, self.trainer_cfg = model_cfg, dict(optim), dict(trainer)
        self.total_steps = total_steps
        # Strategies that shard build the model on the meta device: no rank ever holds the whole model;
        # configure_model shards, materialises the local shards and initialises them (seeded by init_seed).
        self.meta_init, self.init_seed = meta_init, init_seed
        # A ChunkParallelContext when trainer.chunk_parallel > 1 (set by the strategy, mega_suite.distributed.fsdp)
        self.chunk_parallel = None
        self.weights_from = None  # a checkpoint loaded after materialising (init_from=, ckpt=)
        self.tokenizer_digest: str | None = None  # sha256 of the run's tokenizer, saved in its checkpoints
        # One initialisation whatever the strategy: built on the meta device, materialised, seeded, then
        # init_weights() -- at once here, or per shard in configure_model (init_sharded draws the same
        # numbers), so that one seed gives the same initial model on one device, under DDP and FSDP2.
        self.model = build_on_meta(model_cfg)
        if not meta_init:
            self.materialize(sharded=False)
        self.model.gradient_checkpointing = bool(self.trainer_cfg.get("gradient_checkpointing", False))

    # ----------------------------------------------------------------- sharding
    def configure_model(self) -> None:
        """Meta -> shard -> materialise -> initialise (torchtitan's order). Lightning calls this in every
        trainer entry point; a model sharded already is left alone."""
        from torch.distributed.fsdp import FSDPModule

        sharded = uses_model_parallel(self)
        if sharded and not isinstance(self.model, FSDPModule):
            mesh = data_parallel_mesh(self.device_mesh)
            if self.chunk_parallel is not None:
                # gradients must also be summed over the chunk-parallel ranks: shard over the flattened mesh
                from torch.distributed.device_mesh import init_device_mesh

                mesh = init_device_mesh(
                    self.device.type, (self.trainer.world_size,), mesh_dim_names=("dp_cp",)
                )
            apply_fsdp(self.model, mesh, bf16=self.trainer.precision == "bf16-mixed")
        if any(p.is_meta for p in self.model.parameters()):
            self.materialize(sharded)
        self.compile_units()

    def compile_units(self) -> None:
        """``trainer.compile``: ``torch.compile`` each unit the model names (``compile_units()``: the blocks),
        in place, after sharding (torchtitan's order). Per block, not the whole model: identical blocks share
        one compiled graph (compile time of one block, not of the depth), the parameter names and
        checkpoints do not change (no ``_orig_mod.`` prefix), and methods other than ``forward`` that
        training calls (the LM's ``forward_hidden``) run compiled blocks too; a wrapped whole model would
        compile only ``forward``, which language-model training never calls. On the CPU (mode "default"),
        with ``CPU_INDUCTOR_OPTIONS``."""
        if not self.trainer_cfg.get("compile", False):
            return
        backend = self.trainer_cfg.get("compile_backend", "inductor")
        mode = self.trainer_cfg.get("compile_mode", "default")
        trainer = getattr(self, "_trainer", None)  # configure_model may run before the model is moved
        device = trainer.strategy.root_device if trainer is not None else next(self.model.parameters()).device
        if mode == "default" and backend == "inductor" and device.type == "cpu":
            how = dict(options=CPU_INDUCTOR_OPTIONS)  # torch.compile takes a mode or options, not both
        else:
            how = dict(mode=None if mode == "default" else mode)
        for unit in self.model.compile_units():
            if getattr(unit, "_compiled_call_impl", None) is None:
                unit.compile(backend=backend, **how)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """With CUDA-graph compile modes, a new training step begins here: the graphs' outputs of the last
        step may be overwritten (``torch.compiler.cudagraph_mark_step_begin``; no effect on the CPU)."""
        if self.trainer_cfg.get("compile", False) and self.trainer_cfg.get("compile_mode") in CUDAGRAPH_MODES:
            torch.compiler.cudagraph_mark_step_begin()

    def materialize(self, sharded: bool) -> None:
        """Allocate the (local shards of the) meta-device model and initialise it with ``init_seed``."""
        materialize(self.model, self.device, self.init_seed, sharded)
        if self.weights_from is not None:
            load_full_weights(self.model, self.weights_from)

    # ----------------------------------------------------------------- optimisation
    def configure_optimizers(self):
        o = self.optim_cfg
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if o["no_decay_groups"]:
            exempt = self.model.no_weight_decay()
            groups = [
                {"params": [p for n, p in named if n not in exempt], "weight_decay": o["weight_decay"]},
                {"params": [p for n, p in named if n in exempt], "weight_decay": 0.0},
            ]
        else:  # the reference code decays every parameter (docs/architecture.md#paper-vs-reference-code)
            groups = [{"params": [p for _, p in named], "weight_decay": o["weight_decay"]}]
        opt = torch.optim.AdamW(
            groups, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], **self.adamw_kernels()
        )
        fn = lr_lambda(o["schedule"], o["warmup_steps"], self.total_steps, o["min_lr_ratio"])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, fn)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def adamw_kernels(self) -> dict:
        """AdamW's ``fused`` / ``foreach`` flags for ``optim.implementation``: fused (the default) updates
        every parameter in one kernel per step (the same update as the for-loop torch picks on the CPU, several
        times faster: bench/reports/2026-11-24-training-memory-ingest-adamw.md); a config from before the key
        existed gets the default."""
        impl = self.optim_cfg.get("implementation", "fused")
        if impl not in ADAMW_KERNELS:
            raise ValueError(
                f"optim.implementation={impl!r} is invalid; expected one of {', '.join(ADAMW_KERNELS)}"
            )
        return ADAMW_KERNELS[impl]

    def on_train_start(self) -> None:
        """A resumed run restores the optimizer's param groups as saved, ``fused`` / ``foreach`` flags
        included: the configured kernels are set again here, after the restore, so that a run saved with
        another ``optim.implementation`` (or before the key existed) continues with this one. The fused
        kernel wants each step count as a float32 scalar on its parameter's device."""
        flags = self.adamw_kernels()
        for opt in self.trainer.optimizers:
            if not isinstance(opt, torch.optim.AdamW):
                continue
            for group in opt.param_groups:
                group.update(flags)
            if flags["fused"]:
                for param, state in opt.state.items():
                    step = state.get("step")
                    if torch.is_tensor(step):
                        state["step"] = step.to(device=param.device, dtype=torch.float32)
        if self.trainer.ckpt_path:
            for line in self.apply_optim_settings():
                print(f"[mega-suite] resume: {line}", flush=True)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._resumed_config = (checkpoint.get("mega_suite") or {}).get("run_config")

    def apply_optim_settings(self) -> list[str]:
        """A resumed run gets the optimizer's param groups and the schedule's peak lr back as saved: the
        configured ``optim.lr`` (the schedule's peak, ``base_lrs``; this step's lr follows the schedule),
        ``betas``, ``eps`` and ``weight_decay`` are set again here, after the restore, so that what a resumed
        run records is what it trains with. Returns one line per value that changed; the schedule's shape
        and clipping (read from the configuration at every step) are listed when they differ from the
        checkpoint's run."""
        o, changed = self.optim_cfg, {}
        decay = [o["weight_decay"], 0.0] if o.get("no_decay_groups") else None
        for opt in self.trainer.optimizers:
            schedulers = [
                c.scheduler for c in self.trainer.lr_scheduler_configs if c.scheduler.optimizer is opt
            ]
            sched = schedulers[0] if schedulers else None
            for g, group in enumerate(opt.param_groups):
                peak = sched.base_lrs[g] if sched is not None else group.get("initial_lr", group["lr"])
                if peak != o["lr"]:
                    changed["optim.lr"] = (peak, o["lr"])
                    factor = sched.lr_lambdas[g](sched.last_epoch) if sched is not None else 1.0
                    if sched is not None:
                        sched.base_lrs[g] = o["lr"]
                    group["initial_lr"], group["lr"] = o["lr"], o["lr"] * factor
                wanted = {
                    "betas": tuple(o["betas"]),
                    "eps": o["eps"],
                    "weight_decay": o["weight_decay"] if decay is None else decay[min(g, 1)],
                }
                for key, value in wanted.items():
                    if (tuple(group[key]) if key == "betas" else group[key]) != value:
                        changed[f"optim.{key}"] = (group[key], value)
                        group[key] = value
            if sched is not None:
                sched._last_lr = [group["lr"] for group in opt.param_groups]
        lines = [f"{key} {old} -> {new} applied" for key, (old, new) in changed.items()]
        if "optim.lr" in changed:
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
            lines[list(changed).index("optim.lr")] += f" (the schedule's peak; this step's lr {lr:.4g})"
        saved = getattr(self, "_resumed_config", None) or {}
        for section, keys in (
            ("optim", ("schedule", "warmup_steps", "min_lr_ratio", "clip_grad_norm", "implementation")),
            ("trainer", ("max_steps",)),
        ):
            for key in keys:
                old, new = (
                    (saved.get(section) or {}).get(key),
                    (o if section == "optim" else self.trainer_cfg).get(key),
                )
                if old is not None and new is not None and old != new:
                    lines.append(f"{section}.{key} {old} -> {new} applied")
        return lines

    def on_before_optimizer_step(self, optimizer) -> None:
        clip = self.optim_cfg["clip_grad_norm"]
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
            norm = norm.full_tensor()
        self.log("train/grad_norm", norm, on_step=True, on_epoch=False)
        self.log("train/lr", optimizer.param_groups[0]["lr"], on_step=True, on_epoch=False, prog_bar=True)

    def check_finite(self, loss: Tensor) -> None:
        if not torch.isfinite(loss.detach()).all():
            raise NonFiniteLossError(
                f"non-finite training loss {loss.item()} at step {self.global_step}; stopping."
            )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The run's configuration and the model's, so that a checkpoint can be checked against the model a
        later run builds (``ckpt=``, ``init_from=``, ``resume=``) and its hyperparameters compared on resume."""
        checkpoint["mega_suite"] = {
            "run_config": getattr(self, "run_config", None),
            "model": {"arch": type(self.model_cfg).__name__, **dataclasses.asdict(self.model_cfg)},
            "tokenizer_digest": self.tokenizer_digest,
        }


class SequenceClassifier(SuiteModule):
    """Classification over sequences (LRA, speech, images); retrieval when the model has dual_input."""

    def __init__(
        self,
        model_cfg: Any,  # the config dataclass of a registered architecture
        optim: dict,
        trainer: dict,
        total_steps: int,
        label_smoothing: float = 0.0,
        **kwargs: Any,
    ):
        super().__init__(model_cfg, optim, trainer, total_steps, **kwargs)
        self.label_smoothing = label_smoothing
        self.soft_target_loss = SoftTargetCrossEntropy()
        self.hard_label_loss = (
            LabelSmoothingCrossEntropy(label_smoothing) if label_smoothing > 0 else nn.CrossEntropyLoss()
        )
        n = model_cfg.num_classes
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=n)
        self.eval_acc = nn.ModuleList(torchmetrics.Accuracy(task="multiclass", num_classes=n) for _ in STAGES)
        self.top5 = None
        if n > 5:
            self.top5 = nn.ModuleList(
                torchmetrics.Accuracy(task="multiclass", num_classes=n, top_k=5) for _ in STAGES
            )

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        if self.model_cfg.dual_input:
            return self.model(
                batch["input1"], batch.get("padding_mask1"), batch["input2"], batch.get("padding_mask2")
            )
        return self.model(batch["input"], batch.get("padding_mask"))

    def loss(self, logits: Tensor, label: Tensor) -> Tensor:
        """Training loss, mean over the batch of -sum_k y_k log softmax(z)_k with targets y:

        - soft targets ``[B, K]`` (timm mixup / cutmix, label smoothing already mixed in): y = label
          (timm ``SoftTargetCrossEntropy``);
        - hard labels ``[B]`` with smoothing eps > 0: y = (1 - eps) onehot(label) + eps / K
          (timm ``LabelSmoothingCrossEntropy``);
        - hard labels, eps = 0: y = onehot(label) (cross-entropy).
        """
        if label.dim() == 2:
            return self.soft_target_loss(logits, label)
        return self.hard_label_loss(logits, label)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self(batch)
        label = batch["label"]
        loss = self.loss(logits, label)
        self.check_finite(loss)
        hard = label.argmax(-1) if label.dim() == 2 else label
        self.train_acc(logits, hard)
        self.log("train/loss", loss, on_step=True, prog_bar=True, sync_dist=True)  # the global batch's mean
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        stage = STAGES[dataloader_idx]
        logits = self(batch)
        label = batch["label"]
        hard = label.argmax(-1) if label.dim() == 2 else label
        loss = F.cross_entropy(logits, hard)
        self.eval_acc[dataloader_idx](logits, hard)
        kw = dict(on_epoch=True, add_dataloader_idx=False, batch_size=hard.shape[0], sync_dist=True)
        self.log(f"{stage}/loss", loss, prog_bar=stage == "val", **kw)
        self.log(f"{stage}/acc", self.eval_acc[dataloader_idx], prog_bar=stage == "val", **kw)
        if self.top5 is not None:
            self.top5[dataloader_idx](logits, hard)
            self.log(f"{stage}/acc_top5", self.top5[dataloader_idx], **kw)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.validation_step(batch, batch_idx, 1)


class CausalLM(SuiteModule):
    """Next-token prediction; targets of -100 are ignored.

    Training batches are {"input", "target"} [B, L]. Evaluation batches that carry "first_segment" are
    consecutive segments of one stream (batch size 1): the streaming cache is carried across them and reset
    at each document's first segment, so every token is scored with its whole document as context, in
    bounded memory. Word-level perplexity (WikiText-103, PG19) = exp(NLL of the scored targets / words of
    the scored text): each segment carries ``words``, the number of words whose last token is one of its
    targets, so the ratio is right for a whole split and for any prefix of it (``limit_val_batches``); a
    document cut mid-way counts the words of its scored part. Loaders without ``words`` report token-level
    perplexity only.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._stream_cache: dict[int, Any] = {}
        self._totals: dict[int, list[float]] = {}

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)[0]

    def lm_loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        hidden, _ = self.model.forward_hidden(batch["input"])
        target = batch["target"]
        nll = self.model.token_nll(hidden, target).sum()
        return nll, (target != -100).sum()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        cp = self.chunk_parallel
        if cp is None:
            nll, count = self.lm_loss(batch)
            loss = nll / count.clamp(min=1)
        else:
            loss, nll, count = self._chunk_parallel_loss(batch, cp)
        logged = self._mean_over_ranks(nll.detach(), count)
        self.check_finite(logged)
        self.log("train/loss", logged, on_step=True, prog_bar=True)
        self.log("train/ppl", torch.exp(logged.detach().clamp(max=30)), on_step=True)
        return loss

    def _chunk_parallel_loss(self, batch: dict[str, Tensor], cp) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's chunk-aligned slice of the batch; the loss is the mean over the whole sequences.

        share_r = NLL_r / (tokens of the whole group), so sum_r share_r is the sequences' mean NLL. FSDP2
        averages gradients over all dp x P ranks, so each rank returns P * share_r: the average is then the
        mean over the data-parallel replicas of the group sums. Returns (loss to back-propagate, this slice's
        NLL sum, its token count).
        """
        nll, count = self.lm_loss(slice_batch(batch, cp.rank, cp.world, self.model.cfg.chunk_size))
        share = global_mean_loss(nll, count, cp)
        return share * cp.world, nll, count

    def _mean_over_ranks(self, nll: Tensor, count: Tensor) -> Tensor:
        """The logged training loss: the mean NLL over every token of the global batch (all ranks' slices and
        replicas), the same number under every strategy; rank 0's own share of the batch otherwise."""
        trainer = self._trainer
        if trainer is None or trainer.world_size <= 1:
            return nll / count.clamp(min=1)
        total = torch.stack([nll.double(), count.double()])
        total = trainer.strategy.reduce(total, reduce_op="sum")
        return (total[0] / total[1].clamp(min=1)).to(nll.dtype)

    def _chunk_parallel_hidden(self, batch: dict[str, Tensor], cp) -> tuple[Tensor, Tensor]:
        """Evaluation of a [B, L] batch under chunk parallelism: this rank's chunk-aligned slice (the slices
        of training when P·C divides L, else ceil(L/P) rounded up to C, the last shorter), run with the
        group's state exchange. Returns (hidden, target) of the slice: the NLL sums of the group's ranks add
        up to the whole batch's, each token counted once."""

        length, chunk = batch["input"].shape[1], self.model.cfg.chunk_size
        bounds = slice_bounds(length, cp.world, chunk, even=length % (cp.world * chunk) == 0)
        start, stop = bounds[cp.rank]
        with cp.with_lengths([b - a for a, b in bounds]).attached(self.model):
            hidden, _ = self.model.forward_hidden(batch["input"][:, start:stop])
        return hidden, batch["target"][:, start:stop]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # The chunk-parallel layers stay attached through the backward (activation checkpointing recomputes
        # the norms and CEMA there) and are cleared before any evaluation, which attaches its own.
        if self.chunk_parallel is not None:
            attach(self.model, self.chunk_parallel)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.chunk_parallel is not None:
            attach(self.model, None)

    def on_validation_epoch_start(self) -> None:
        self._stream_cache.clear()
        self._totals.clear()

    on_test_epoch_start = on_validation_epoch_start

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        target = batch["target"]
        cp, counts_words = self.chunk_parallel, True
        if "first_segment" in batch:
            # Streaming loaders split documents across ranks (StreamSegments; under chunk parallelism across
            # every rank, datamodules.text_lm.eval_stream_rank): totals are summed like the others.
            cache = None if bool(batch["first_segment"].any()) else self._stream_cache.get(dataloader_idx)
            hidden, cache = self.model.forward_hidden(batch["input"], cache, use_cache=True)
            self._stream_cache[dataloader_idx] = cache
        elif cp is not None:  # the ranks of a chunk group read the same batch: each scores its slice
            hidden, target = self._chunk_parallel_hidden(batch, cp)
            counts_words = cp.rank == 0
        else:
            hidden, _ = self.model.forward_hidden(batch["input"])
        nll = self.model.token_nll(hidden, target).sum()
        totals = self._totals.setdefault(dataloader_idx, [0.0, 0, "first_segment" in batch, None])
        totals[0] += float(nll)
        totals[1] += int((target != -100).sum())
        if "words" in batch and counts_words:
            totals[3] = (totals[3] or 0) + int(batch["words"].sum())

    def _log_totals(self) -> None:
        for idx, (nll, count, _streaming, words) in sorted(self._totals.items()):
            stage = STAGES[idx]
            total = torch.tensor([nll, float(count)], dtype=torch.float64, device=self.device)
            if self.trainer.world_size > 1:
                words_t = torch.tensor([float(words or 0)], dtype=torch.float64, device=self.device)
                total = self.trainer.strategy.reduce(torch.cat([total, words_t]), reduce_op="sum")
                words = float(total[2])
            nll_sum, tokens = float(total[0]), max(1.0, float(total[1]))
            loss = nll_sum / tokens
            self.log(f"{stage}/loss", loss, prog_bar=stage == "val", rank_zero_only=True)
            self.log(f"{stage}/ppl", math.exp(min(loss, 30.0)), rank_zero_only=True)
            if words:
                self.log(f"{stage}/word_ppl", math.exp(min(nll_sum / words, 30.0)), rank_zero_only=True)

    def on_validation_epoch_end(self) -> None:
        self._log_totals()

    on_test_epoch_end = on_validation_epoch_end

    def test_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.validation_step(batch, batch_idx, 1)


def build_module(task: str, model_cfg: Any, **kwargs: Any) -> SuiteModule:
    if task == "classify":
        return SequenceClassifier(model_cfg, **kwargs)
    if task == "lm":
        return CausalLM(model_cfg, **kwargs)
    raise ValueError(f"task must be classify or lm, got {task!r}")
