"""From a run plan to what it does: a Lightning fit / validate / test / eval_context, or an after-training mode
(docs/configuration.md#the-run-plan).

``run(cfg)`` makes the plan (``mega_suite.config.run_plan``: every key, file and folder checked, nothing
created), prepares the data, builds the module and checks every checkpoint it reads against the model it
built, loads what an after-training mode evaluates; only then does it claim the run folder (created and
locked: ``mega_suite.storage.runs``), write ``config.yaml`` (``eval.yaml`` for an evaluation) and
``plan.json`` into it, and run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from datamodules.common import reset_data_parallel
from mega_suite.config import ConfigError, to_yaml
from mega_suite.config.after import AFTER_MODES
from mega_suite.config.run_plan import LAUNCHED, SHARDING_STRATEGIES, RunPlan, check_model, make_plan
from mega_suite.evaluation.context import (
    default_context_lengths,
    documents_from_segments,
    eval_context,
    eval_context_chunk_parallel,
    write_report,
)
from mega_suite.evaluation.generate import check_generate
from mega_suite.models import arch_of
from mega_suite.storage.checkpoints import Checkpoint, load_into, open_checkpoint
from mega_suite.storage.runs import EVAL_CONFIG, claim, tidy_for_resume
from mega_suite.training.callbacks import (
    GracefulStop,
    LogLines,
    StepProgressBar,
    StepSeed,
    StopRequested,
    TokenThroughput,
)
from mega_suite.training.module import NonFiniteLossError, build_module
from mega_suite.training.saving import AtomicCheckpointIO, SuiteCheckpoint, save_last
from mega_suite.training.strategy import make_strategy
from mega_suite.training.trained import (
    file_digest,
    load_evaluated,
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


def batch_limit(value: int | float) -> int | float:
    """Lightning's rule: a whole number counts batches (``1``: one batch), a float up to 1.0 is a fraction
    (``1.0``: all); a whole float past 1 (``3.0``) is that many batches."""
    return int(value) if isinstance(value, float) and value > 1.0 else value


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
    limit_val, limit_test = batch_limit(t.limit_val_batches), batch_limit(t.limit_test_batches)
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
        enable_model_summary=False,  # one line instead (the runner's): the table's FLOPs column reads 0
    )


class _NotForPeople(logging.Filter):
    """Lightning's console lines that say nothing about this run: adverts for its other products and the
    accelerators this suite never uses."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(("💡", "TPU available", "HPU available"))


def quiet_lightning() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NotForPeople) for f in logger.filters):
            logger.addFilter(_NotForPeople())
    # Lightning's own use of a torch API it deprecated; nothing a user can act on
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def run(cfg: DictConfig | RunPlan, extra_callbacks: list | None = None) -> dict[str, Any]:
    """Execute a configuration ``load_config`` validated (or its plan). Returns the final metrics and the
    folder written (``run_dir``)."""
    quiet_lightning()
    plan = cfg if isinstance(cfg, RunPlan) else make_plan(cfg)
    L.seed_everything(plan.cfg.seed, workers=True, verbose=False)
    reset_data_parallel()  # an earlier chunk-parallel run in this process declared its own data ranks
    for note in plan.notes:
        print(f"[mega-suite] {note}")
    if plan.mode in AFTER_MODES:  # a trained model, no trainer: generate / lm_eval / passkey
        return _after_training(plan)
    return _with_trainer(plan, extra_callbacks)


@contextlib.contextmanager
def claimed(plan: RunPlan) -> Iterator[Path]:
    """The plan's folder, created and locked for the block (ranks that Lightning's launcher started use rank
    0's); its configuration and plan written into it."""
    if plan.launched:
        yield plan.output.path
        return
    folder = claim(plan.output)
    try:
        path = folder.path
        os.environ[LAUNCHED] = f"{path}{os.pathsep}{plan.resume.path if plan.resume else ''}"
        if plan.resume is not None and plan.output.kind == "train":
            tidy_for_resume(path, plan.resume.skipped)
        written = OmegaConf.create(OmegaConf.to_container(plan.cfg))
        written.run_dir = str(path)
        if plan.output.kind == "eval":
            name = EVAL_CONFIG
        elif plan.resume is not None and plan.output.resuming and (path / "config.yaml").exists():
            name = f"config.resumed-{time.strftime('%Y%m%d-%H%M%S')}.yaml"
        else:
            name = "config.yaml"
        from mega_suite.storage.atomic import write_text

        write_text(path / name, to_yaml(written))
        plan.write(path)
        resumed = f" (resuming {plan.resume.path}, step {plan.resume.global_step})" if plan.resume else ""
        print(f"[mega-suite] {plan.mode}: {path}{resumed}; configuration in {name}")
        yield path
    finally:
        os.environ.pop(LAUNCHED, None)
        folder.release()


def _after_training(plan: RunPlan) -> dict[str, Any]:
    loaders = load_evaluated(plan)  # the model and tokenizer: checked before the folder exists
    if plan.mode == "generate":
        check_generate(plan.cfg, loaders[0](), plan.prompt)
    elif plan.mode == "lm_eval":
        from mega_suite.evaluation.harness import load_tasks, task_manager

        names = list(plan.cfg.lm_eval.tasks)
        load_tasks(task_manager(names, plan.cfg.lm_eval.include_path), names)  # unknown task, data offline
    with claimed(plan) as folder:
        metrics = run_after_training(plan, loaders, folder)
        write_metrics(folder, metrics)
    return {**metrics, "run_dir": str(folder)}


SETUP_STAGE = {"fit": "fit", "validate": "validate", "test": "test", "eval_context": "validate"}


def _with_trainer(plan: RunPlan, extra_callbacks: list | None) -> dict[str, Any]:
    cfg = plan.cfg
    dm = plan.build_data()
    dm.prepare_data()
    dm.setup(
        SETUP_STAGE[plan.mode]
    )  # reads (and checks) the data now, before a folder exists; kept for the trainer
    plan = plan.with_data(dm)
    if plan.global_batch_line():
        print(f"[mega-suite] {plan.global_batch_line()}")
    module = build_run_module(plan)
    reads = [("init_from", plan.init_from), ("resume", plan.resume), *(("ckpt", c) for c in plan.evaluated)]
    for key, found in reads:  # every checkpoint this run reads holds the model it built
        if found is not None:
            check_model(found, module.model, plan.model, cfg, key)
    tokenizer = getattr(dm, "tokenizer_file", None)
    digest = file_digest(tokenizer) if tokenizer is not None and Path(tokenizer).is_file() else None
    check_tokenizer(plan.resume, digest, tokenizer)

    with claimed(plan) as run_dir:  # nothing was written before this point
        if cfg.mode == "fit" and not plan.launched:
            save_run_tokenizer(dm, run_dir)  # a run folder is self-contained
        if plan.init_from is not None:
            init_weights_from(module, plan.init_from, resuming=plan.resume is not None)
        module.run_config = dict(OmegaConf.to_container(cfg, resolve=True), run_dir=str(run_dir))
        module.run_config["trainer"]["accumulate_grad_batches"] = plan.accumulate_grad_batches
        module.tokenizer_digest = digest
        trainer = build_trainer(plan, run_dir, extra_callbacks)
        print(f"[mega-suite] model: {model_line(module.model)}")
        if trainer.logger is not None and plan.resume is None:
            trainer.logger.log_hyperparams(_flatten(module.run_config))
        data = ValWithTest(dm)
        if cfg.mode == "fit":
            metrics = _fit(trainer, module, data, plan, run_dir)
        elif cfg.mode in ("validate", "test"):
            metrics = _evaluate(trainer, module, data, plan)
        else:
            metrics = run_eval_context(cfg, module, dm, trainer, run_dir, plan.evaluated)
        if trainer.is_global_zero:
            write_metrics(run_dir, metrics)
    metrics["run_dir"] = str(run_dir)
    return metrics


def write_metrics(folder: Path, metrics: dict[str, Any]) -> None:
    """The command's final metrics at full precision (``metrics.json``; the console shows four digits)."""
    import json

    from mega_suite.storage.atomic import write_text

    write_text(folder / "metrics.json", json.dumps(metrics, indent=1, sort_keys=True) + "\n")


def model_line(model) -> str:
    """The model in one line: its class and parameter count (tied weights once)."""
    from mega_suite.models import count_parameters

    total = count_parameters(model)
    size = (
        f"{total / 1e9:.2f}B"
        if total >= 1e9
        else f"{total / 1e6:.2f}M"
        if total >= 1e6
        else f"{total / 1e3:.1f}K"
    )
    return f"{type(model).__name__}, {size} parameters"


def check_tokenizer(resume: Checkpoint | None, digest: str | None, tokenizer) -> None:
    """A resumed run trains on with the tokenizer it was started with (its digest is in its checkpoints)."""
    if (
        resume is None
        or resume.tokenizer_digest is None
        or digest is None
        or digest == resume.tokenizer_digest
    ):
        return
    raise ConfigError(
        f"resume={resume.path}: the run was trained with another tokenizer than {tokenizer} (their sha256 "
        "differ); resume with the tokenizer it was started with (data.options.tokenizer_path), or start a new "
        "run from its weights with init_from="
    )


def _fit(trainer: L.Trainer, module, data, plan: RunPlan, run_dir: Path) -> dict[str, float]:
    resume = str(plan.resume.path) if plan.resume is not None else None
    try:
        trainer.fit(module, datamodule=data, ckpt_path=resume)
    except NonFiniteLossError as exc:
        print(f"error: {exc} {kept_checkpoint(run_dir)}", file=sys.stderr)
        raise
    except StopRequested as exc:
        print(f"[mega-suite] {exc}; resume with resume=auto")
    stopped = any(isinstance(cb, GracefulStop) and cb.requested for cb in trainer.callbacks)
    if not trainer.interrupted and not stopped:  # a graceful stop saved mid-epoch already: keep that
        save_last(trainer, run_dir / "checkpoints" / "last.ckpt")
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def _evaluate(trainer: L.Trainer, module, data, plan: RunPlan) -> dict[str, float]:
    """mode=validate | test of the evaluated checkpoint: its weights loaded into the model (a sharded
    checkpoint under a sharding strategy through Lightning, which reads the shards on every rank)."""
    found = plan.evaluated[0]
    ckpt = None
    if found.format == "sharded" and plan.sharded:
        ckpt = str(found.path)
    elif getattr(module, "meta_init", False):
        module.weights_from = found  # loaded into the shards once they exist (configure_model)
    else:
        load_into(module.model, found)
    fn = trainer.validate if plan.mode == "validate" else trainer.test
    out = fn(module, datamodule=data, ckpt_path=ckpt)
    return {k: float(v) for d in out for k, v in d.items()}


def kept_checkpoint(run_dir: Path) -> str:
    """What the run keeps after it stopped on a non-finite loss: never a checkpoint that does not exist."""
    last = Path(run_dir) / "checkpoints" / "last.ckpt"
    try:
        info = open_checkpoint(last, "last")
    except ValueError:
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


def init_weights_from(module, found: Checkpoint, resuming: bool) -> None:
    """Fine-tuning: the model weights of a checked checkpoint (any format), loaded strictly (every name and
    shape must match); optimizer, schedule and step start afresh."""
    if resuming:
        print(
            f"[mega-suite] resuming: init_from={found.path} ignored (the resumed checkpoint has the weights)"
        )
        return
    if getattr(module, "meta_init", False):  # loaded into the shards once they exist (configure_model)
        module.weights_from = found
        print(f"[mega-suite] model weights will be initialised from {found.path}")
        return
    try:
        load_into(module.model, found)
    except ValueError as exc:
        raise ConfigError(f"init_from={found.path}: {exc}") from None
    print(f"[mega-suite] model weights initialised from {found.path}")


def run_eval_context(cfg: DictConfig, module, dm, trainer, run_dir: Path, evaluated=()) -> dict[str, Any]:
    """Validation perplexity against context length (figure 5 of the paper) from a checkpoint."""

    if any(p.is_meta for p in module.model.parameters()):
        # sharding strategies (and so trainer.chunk_parallel) build the model on the meta device; here every
        # process holds the whole model
        module.materialize(sharded=False)
    if evaluated:
        load_into(module.model, evaluated[0])  # any checkpoint format the reader knows
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

    note = f"Model: {arch_of(module.model.cfg).context_note(module.model.cfg)}"
    table, plot = write_report(rows, run_dir, writer, note=note)
    print(table.read_text())
    print(f"[mega-suite] wrote {table} and {plot}")
    kind = "word_ppl" if all("word_ppl" in r for r in rows) else "token_ppl"
    return {f"{kind}@{r['context']}": r[kind] for r in rows}


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
