"""From a resolved configuration to a Lightning run: run directory, data, module, trainer, fit / validate / test."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from datamodules.common import reset_data_parallel
from mega_suite.config import (
    ConfigError,
    to_yaml,
)
from mega_suite.config.after import AFTER_MODES
from mega_suite.config.run_plan import SHARDING_STRATEGIES, RunPlan, resolve_plan
from mega_suite.evaluation.context import (
    default_context_lengths,
    documents_from_segments,
    eval_context,
    eval_context_chunk_parallel,
    write_report,
)
from mega_suite.models import arch_of
from mega_suite.models.bundle import is_bundle
from mega_suite.training import preflight
from mega_suite.training.callbacks import (
    GracefulStop,
    LogLines,
    StepProgressBar,
    StepSeed,
    StopRequested,
    TokenThroughput,
)
from mega_suite.training.checkpoint import (
    AtomicCheckpointIO,
    is_lightning_checkpoint,
    is_sharded_checkpoint,
    load_reference_file,
)
from mega_suite.training.module import NonFiniteLossError, build_module
from mega_suite.training.saving import SuiteCheckpoint, save_last
from mega_suite.training.strategy import make_strategy
from mega_suite.training.trained import (
    checkpoint_path,
    periodic_checkpoint,
    run_after_training,
    save_run_tokenizer,
)


class ValWithTest(L.LightningDataModule):
    """Wrap a data module so validation runs on [val, test]: test at the best validation step is logged.

    Lightning attaches the trainer to, and calls the batch hooks of, the wrapper only: both are passed on to
    the inner module (its sampler reads the trainer's rank; ImageNet mixes batches in ``on_after_batch_transfer``).
    Other attributes (``num_words``, ``vocab_size``, ...) are read from the inner module.
    """

    def __init__(self, inner: L.LightningDataModule):
        self.inner = inner
        super().__init__()

    @property
    def trainer(self):
        return self.inner.trainer

    @trainer.setter
    def trainer(self, trainer) -> None:
        self.inner.trainer = trainer

    def __getattr__(self, name: str) -> Any:
        # Called only when normal lookup fails; `inner` itself is read from __dict__ so that a half-built or
        # unpickled wrapper raises AttributeError instead of recursing.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def prepare_data(self) -> None:
        self.inner.prepare_data()

    def setup(self, stage: str) -> None:
        self.inner.setup(stage)

    def teardown(self, stage: str) -> None:
        self.inner.teardown(stage)

    def train_dataloader(self):
        return self.inner.train_dataloader()

    def val_dataloader(self):
        if type(self.inner).test_dataloader is L.LightningDataModule.test_dataloader:  # no test split
            return [self.inner.val_dataloader()]
        return [self.inner.val_dataloader(), self.inner.test_dataloader()]

    def test_dataloader(self):
        return self.inner.test_dataloader()

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.inner.on_before_batch_transfer(batch, dataloader_idx)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return self.inner.transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.inner.on_after_batch_transfer(batch, dataloader_idx)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def build_strategy(cfg: DictConfig):
    """auto | ddp | fsdp (FSDP2 over every rank: a 1-D mesh) | hsdp (shard in a node, replicate across nodes);
    the meshes are ``mega_suite.distributed.fsdp.build_mesh``'s."""
    s = cfg.trainer.strategy
    if s in SHARDING_STRATEGIES:
        # sharded checkpoints (torch.distributed.checkpoint): a save never gathers the model on one rank
        return make_strategy(
            s,
            chunk_parallel=cfg.trainer.chunk_parallel,
            chunk_parallel_mode=cfg.trainer.chunk_parallel_mode,
            save_distributed_checkpoint=True,
        )
    if s == "ddp":
        return "ddp_find_unused_parameters_false" if torch.cuda.is_available() else "ddp"
    return "auto"


def build_trainer(plan: RunPlan, run_dir: Path, extra_callbacks: list | None = None) -> L.Trainer:
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import TensorBoardLogger

    cfg, t = plan.cfg, plan.cfg.trainer
    # every run sets it (also back to "highest"): a process that runs several (tests, notebooks) keeps no
    # earlier run's choice
    torch.set_float32_matmul_precision(t.float32_matmul_precision)
    ckpt_dir = run_dir / "checkpoints"
    checkpoint = SuiteCheckpoint(  # the one writer of last.ckpt; only finite checkpoints (training.saving)
        dirpath=ckpt_dir,
        filename="best-step{step}",
        auto_insert_metric_name=False,
        monitor=cfg.monitor,
        mode=cfg.monitor_mode,
        save_top_k=1,
        save_last=True,
    )
    callbacks = [
        checkpoint,
        StepSeed(cfg.seed),
        TokenThroughput(t.log_every_n_steps, plan.flops_per_token, t.peak_tflops),
        GracefulStop(ckpt_dir / "last.ckpt"),
        LearningRateMonitor(logging_interval="step"),
    ]
    callbacks.append(StepProgressBar() if t.progress_bar else LogLines(t.log_every_n_steps))
    periodic = periodic_checkpoint(cfg, ckpt_dir)  # trainer.save_every_n_steps
    if periodic is not None:
        callbacks.append(periodic)
    logger = TensorBoardLogger(save_dir=str(run_dir), name="", version="", default_hp_metric=False)
    limit_val = t.limit_val_batches if t.limit_val_batches <= 1.0 else int(t.limit_val_batches)
    limit_test = t.limit_test_batches if t.limit_test_batches <= 1.0 else int(t.limit_test_batches)
    return L.Trainer(
        default_root_dir=str(run_dir),
        max_steps=t.max_steps,
        max_epochs=t.max_epochs,
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=build_strategy(cfg),
        precision=t.precision,
        accumulate_grad_batches=plan.accumulate_grad_batches,
        val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=None,
        limit_val_batches=limit_val,
        limit_test_batches=limit_test,
        log_every_n_steps=t.log_every_n_steps,
        deterministic=t.deterministic,
        enable_progress_bar=t.progress_bar,
        callbacks=callbacks + list(extra_callbacks or []),
        logger=logger,
        plugins=[AtomicCheckpointIO()],
        num_sanity_val_steps=0,
        enable_model_summary=True,
    )


_RUN_ENV = "MEGA_SUITE_RUN"  # "run_dir<pathsep>resume_ckpt" of the launching rank 0


def run(cfg: DictConfig, extra_callbacks: list | None = None) -> dict[str, Any]:
    """Execute a resolved configuration. Returns the final metrics (and the run directory).

    Everything a run reads or writes is checked before its directory is created (``preflight``): where it
    goes, each checkpoint it reads (also against the model built once the data is prepared), the machine."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    reset_data_parallel()  # an earlier chunk-parallel run in this process declared its own data ranks
    # Lightning starts ranks 1.. of a multi-device run by re-running this command (its subprocess launcher):
    # they take the run directory and checkpoint rank 0 resolved (and checked), passed down in the environment.
    launched = os.environ.get(_RUN_ENV)
    if launched:
        run_dir_text, resume_text = launched.split(os.pathsep)
        target = preflight.RunTarget(Path(run_dir_text), fresh=False)
        resume = preflight.read_checkpoint(resume_text, "resume") if resume_text else None
        target.resume = resume
    else:
        target = preflight.resolve_run(cfg)
        preflight.check_accelerator(cfg)
        preflight.check_writable(target, cfg)
    if cfg.mode in AFTER_MODES and cfg.ckpt:  # a run directory or bundle too: resolved as the modes read it
        checkpoint_path(cfg.ckpt)
    keys = ("init_from",) if cfg.mode in AFTER_MODES else ("ckpt", "init_from")
    reads = {key: preflight.read_checkpoint(cfg[key], key) for key in keys if cfg[key]}
    for key, info in reads.items():
        preflight.check_config_match(info, cfg, key)
    try:
        return _run_in(cfg, target, reads, bool(launched), extra_callbacks)
    finally:
        if not launched:
            os.environ.pop(_RUN_ENV, None)


def _start(cfg: DictConfig, target: preflight.RunTarget, launched: bool, resume_ckpt: Path | None) -> Path:
    """Claim the run directory (rank 0) and write the resolved configuration into it."""
    run_dir = target.run_dir
    if not launched:
        run_dir = preflight.claim_run_dir(target, cfg)
        if target.resume is not None:
            preflight.tidy_for_resume(target)
        os.environ[_RUN_ENV] = f"{run_dir}{os.pathsep}{resume_ckpt or ''}"
    cfg.run_dir = str(run_dir)
    text = to_yaml(cfg)
    print(text)
    name = "config.yaml" if resume_ckpt is None else f"config.resumed-{time.strftime('%Y%m%d-%H%M%S')}.yaml"
    if not launched:
        (run_dir / name).write_text(text)
    print(f"[mega-suite] run directory: {run_dir}" + (f" (resuming {resume_ckpt})" if resume_ckpt else ""))
    return run_dir


def _run_in(
    cfg: DictConfig,
    target: preflight.RunTarget,
    reads: dict[str, preflight.CheckpointInfo],
    launched: bool,
    extra_callbacks: list | None,
) -> dict[str, Any]:
    resume_ckpt = target.resume.path if target.resume is not None else None
    cfg.run_dir = str(target.run_dir)
    if cfg.mode in AFTER_MODES:  # a trained model, no trainer: generate / lm_eval / passkey
        run_dir = _start(cfg, target, launched, resume_ckpt)
        return {**run_after_training(cfg, run_dir), "run_dir": str(run_dir)}
    plan = resolve_plan(cfg)
    dm = plan.build_data()
    dm.prepare_data()
    plan = plan.with_data(dm)
    if plan.global_batch_line():
        print(f"[mega-suite] {plan.global_batch_line()}")
    module = build_run_module(plan)
    checked = dict(reads, **({"resume": target.resume} if target.resume is not None else {}))
    for key, info in checked.items():  # every checkpoint this run reads holds the model it built
        preflight.check_model(info, module.model, plan.model, cfg, key)

    run_dir = _start(cfg, target, launched, resume_ckpt)  # nothing was written before this point
    if cfg.mode == "fit" and not launched:
        save_run_tokenizer(dm, run_dir)  # a run directory is self-contained
    if cfg.init_from:
        init_weights_from(module, cfg.init_from, resuming=resume_ckpt is not None, mode=cfg.mode)
    module.run_config = OmegaConf.to_container(cfg, resolve=True)
    module.run_config["trainer"]["accumulate_grad_batches"] = plan.accumulate_grad_batches
    trainer = build_trainer(plan, run_dir, extra_callbacks)
    if trainer.logger is not None and resume_ckpt is None:
        trainer.logger.log_hyperparams(_flatten(module.run_config))
    data = ValWithTest(dm)
    if cfg.mode == "fit":
        try:
            trainer.fit(module, datamodule=data, ckpt_path=str(resume_ckpt) if resume_ckpt else None)
        except NonFiniteLossError as exc:
            print(f"error: {exc} {kept_checkpoint(run_dir)}", file=sys.stderr)
            raise
        except StopRequested as exc:
            print(f"[mega-suite] {exc}; resume with resume=auto")
        stopped = any(isinstance(cb, GracefulStop) and cb.requested for cb in trainer.callbacks)
        if not trainer.interrupted and not stopped:  # a graceful stop saved mid-epoch already: keep that
            save_last(trainer, run_dir / "checkpoints" / "last.ckpt")
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    elif cfg.mode in ("validate", "test"):
        ckpt = cfg.ckpt or (str(resume_ckpt) if resume_ckpt else None)
        if ckpt is None:
            raise ConfigError(f"mode={cfg.mode} needs ckpt=PATH (or resume=auto / a run directory)")
        fn = trainer.validate if cfg.mode == "validate" else trainer.test
        sharding = cfg.trainer.strategy in SHARDING_STRATEGIES
        if not is_lightning_checkpoint(ckpt) or (is_sharded_checkpoint(ckpt) and not sharding):
            # model weights alone (e.g. `python -m mega_suite.training.checkpoint consolidate`), or a sharded
            # checkpoint read on one process: load the weights, evaluate without trainer state
            if getattr(module, "meta_init", False):
                module.weights_from = str(ckpt)
            else:
                load_reference_file(module.model, ckpt)
            ckpt = None
        out = fn(module, datamodule=data, ckpt_path=ckpt)
        metrics = {k: float(v) for d in out for k, v in d.items()}
    elif cfg.mode == "eval_context" and cfg.task == "lm":
        metrics = run_eval_context(cfg, module, dm, trainer, run_dir)
    else:
        raise ConfigError(f"mode={cfg.mode!r} is not available for task {cfg.task!r}")
    metrics["run_dir"] = str(run_dir)
    return metrics


def kept_checkpoint(run_dir: Path) -> str:
    """What the run keeps after it stopped on a non-finite loss: never a checkpoint that does not exist."""
    last = Path(run_dir) / "checkpoints" / "last.ckpt"
    try:
        info = preflight.read_checkpoint(last, "last")
    except ConfigError:
        return (
            "No checkpoint was saved before it (nothing to resume): lower optim.lr or enable clipping "
            "(optim.clip_grad_norm) and start again."
        )
    return (
        f"The last good checkpoint, {last} (step {info.global_step}), is kept: lower optim.lr, enable clipping "
        "(optim.clip_grad_norm), and continue it with resume=auto (the new optim.* values apply)."
    )


def build_run_module(plan: RunPlan) -> L.LightningModule:
    """The LightningModule of a run; classifiers get the data module's ``label_smoothing`` (DeiT's 0.1 for
    ImageNet), applied to hard labels when mixup / cutmix are off (mixed labels carry it already)."""
    cfg = plan.cfg
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer["accumulate_grad_batches"] = plan.accumulate_grad_batches
    kwargs = dict(
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        trainer=trainer,
        total_steps=cfg.trainer.max_steps,
        meta_init=plan.sharded,
        init_seed=cfg.seed,
    )
    if cfg.task == "classify":
        kwargs["label_smoothing"] = plan.label_smoothing
    return build_module(cfg.task, plan.model, **kwargs)


def init_weights_from(module, path: str, resuming: bool, mode: str) -> None:
    """Fine-tuning: the model weights of a suite checkpoint (``.ckpt``) or a reference state dict, loaded
    strictly (every name and shape must match); optimizer, schedule and step start afresh."""
    if mode != "fit":
        raise ConfigError(f"init_from applies to mode=fit; for mode={mode} pass the checkpoint as ckpt=PATH")
    if resuming:
        print(f"[mega-suite] resuming: init_from={path} ignored (the resumed checkpoint has the weights)")
        return

    if not Path(path).is_file() and not is_sharded_checkpoint(path) and not is_bundle(path):
        raise FileNotFoundError(
            f"init_from={path}: no such checkpoint file (or sharded checkpoint directory or bundle)"
        )
    if getattr(module, "meta_init", False):  # loaded into the shards once they exist (configure_model)
        module.weights_from = str(path)
        print(f"[mega-suite] model weights will be initialised from {path}")
        return

    try:
        load_reference_file(module.model, path)
    except ValueError as exc:
        raise ConfigError(f"init_from={path}: {exc}") from None
    print(f"[mega-suite] model weights initialised from {path}")


def run_eval_context(cfg: DictConfig, module, dm, trainer, run_dir: Path) -> dict[str, Any]:
    """Validation perplexity against context length (figure 5 of the paper) from a checkpoint."""

    if any(p.is_meta for p in module.model.parameters()):
        # sharding strategies (and so trainer.chunk_parallel) build the model on the meta device; here every
        # process holds the whole model
        module.materialize(sharded=False)
    if cfg.ckpt:
        load_reference_file(module.model, cfg.ckpt)  # a Lightning .ckpt, a state dict or a sharded directory
    else:
        print("[mega-suite] eval_context without ckpt=PATH: evaluating the freshly initialised model")
    dm.setup("validate")
    docs, doc_words = [], []
    for doc in documents_from_segments(dm.val_dataloader(), doc_words):
        docs.append(doc)
        if cfg.eval_max_documents and len(docs) >= cfg.eval_max_documents:
            break
    if not docs:
        raise ValueError("eval_context: the validation split has no documents")
    longest = max(d.numel() for d in docs)
    lengths = list(cfg.eval_context_lengths) or default_context_lengths(longest)
    # Words of the documents evaluated (all of them, or the first eval_max_documents).
    words = sum(doc_words[: len(docs)]) or (getattr(dm, "num_words", None) or {}).get("val")
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.trainer.accelerator != "cpu" else "cpu")
    if (
        cfg.trainer.chunk_parallel > 1
    ):  # each window split across P spawned ranks (docs/architecture.md#chunk-parallelism)
        rows = eval_context_chunk_parallel(
            module.model, docs, lengths, cfg.trainer.chunk_parallel, cfg.trainer.chunk_parallel_mode,
            device.type, num_words=words,
        )  # fmt: skip
    else:
        rows = eval_context(module.model.to(device), docs, lengths, num_words=words)
    writer = getattr(trainer.logger, "experiment", None)

    spec = arch_of(module.model.cfg)
    note = f"Model: {spec.name}, {spec.streaming}"
    if spec.name == "llama":
        c = module.model.cfg
        note += f" (window {c.max_seq_len}, stride {c.stride}: context beyond the window is not seen)"
    table, plot = write_report(rows, run_dir, writer, note=note)
    print(table.read_text())
    print(f"[mega-suite] wrote {table} and {plot}")
    return {f"ppl@{r['context']}": r.get("word_ppl", r["token_ppl"]) for r in rows}


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = "None" if v is None else v
        else:
            out[key] = str(v)
    return out
