"""From a resolved configuration to a Lightning run: run directory, data, module, trainer, fit / validate / test."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from mega_suite.callbacks import (
    AtomicCheckpointIO,
    GracefulStop,
    LogLines,
    StepProgressBar,
    StepSeed,
    Throughput,
)
from mega_suite.lightning import NonFiniteLossError, build_module
from mega_suite.settings import model_config, to_yaml


class ValWithTest(L.LightningDataModule):
    """Wrap a data module so validation runs on [val, test]: test at the best validation step is logged."""

    def __init__(self, inner: L.LightningDataModule):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def prepare_data(self) -> None:
        self.inner.prepare_data()

    def setup(self, stage: str) -> None:
        self.inner.setup(stage)

    def train_dataloader(self):
        return self.inner.train_dataloader()

    def val_dataloader(self):
        if type(self.inner).test_dataloader is L.LightningDataModule.test_dataloader:  # no test split
            return [self.inner.val_dataloader()]
        return [self.inner.val_dataloader(), self.inner.test_dataloader()]

    def test_dataloader(self):
        return self.inner.test_dataloader()

    def state_dict(self) -> dict:
        return self.inner.state_dict() if hasattr(self.inner, "state_dict") else {}

    def load_state_dict(self, state: dict) -> None:
        if hasattr(self.inner, "load_state_dict"):
            self.inner.load_state_dict(state)


def build_datamodule(cfg: DictConfig) -> L.LightningDataModule:
    from datamodules import build_datamodule as build

    d = cfg.data
    kwargs = dict(
        data_dir=d.data_dir,
        batch_size=d.batch_size,
        num_workers=d.num_workers,
        seed=cfg.seed,
        max_length=d.max_length,
        pad_to_multiple=d.pad_to_multiple,
    )
    import inspect

    from datamodules import DATAMODULES

    if d.name not in DATAMODULES:
        raise ValueError(f"data.name={d.name!r} is unknown; valid names: {', '.join(sorted(DATAMODULES))}")
    accepted = inspect.signature(DATAMODULES[d.name].__init__).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}  # shared keys a module does not use
    options = OmegaConf.to_container(d.options, resolve=True)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        valid = sorted(k for k in accepted if k != "self")
        raise ValueError(f"data.options {unknown} are not options of data.name={d.name!r}; valid: {valid}")
    kwargs.update(options)
    return build(d.name, **kwargs)


def model_config_for(cfg: DictConfig, dm: Any):
    """Vocabulary size and class count come from the data."""
    updates = {}
    if getattr(dm, "vocab_size", None):
        updates["vocab_size"] = int(dm.vocab_size)
    if cfg.task == "classify" and getattr(dm, "num_classes", None):
        updates["num_classes"] = int(dm.num_classes)
    return model_config(cfg, **updates)


def _latest_run(root: Path, recipe: str) -> Path | None:
    runs = sorted(p for p in (root / recipe).glob("*") if (p / "checkpoints" / "last.ckpt").exists())
    return runs[-1] if runs else None


def resolve_run(cfg: DictConfig) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume from)."""
    root = Path(cfg.run_root)
    resume = cfg.resume
    if resume in (None, "", "none"):
        if cfg.run_dir:
            return Path(cfg.run_dir), None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run = root / cfg.recipe / stamp
        n = 1
        while run.exists():
            run = root / cfg.recipe / f"{stamp}-{n}"
            n += 1
        return run, None
    if resume == "auto":
        run = Path(cfg.run_dir) if cfg.run_dir else _latest_run(root, cfg.recipe)
        if run is None or not (run / "checkpoints" / "last.ckpt").exists():
            print(f"[mega-suite] resume=auto: no earlier run of {cfg.recipe!r} under {root}; starting fresh")
            cfg.resume = None
            return resolve_run(cfg)
        return run, run / "checkpoints" / "last.ckpt"
    path = Path(resume)
    if path.is_dir():
        ckpt = path / "checkpoints" / "last.ckpt"
        if not ckpt.exists():
            raise FileNotFoundError(f"resume={resume}: no checkpoints/last.ckpt in that run directory")
        return path, ckpt
    if path.is_file():
        return path.parent.parent if path.parent.name == "checkpoints" else path.parent, path
    raise FileNotFoundError(f"resume={resume!r}: expected 'auto', a run directory or a .ckpt file")


def build_strategy(cfg: DictConfig):
    s = cfg.trainer.strategy
    if s == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(save_distributed_checkpoint=False)
    if s == "ddp":
        return "ddp_find_unused_parameters_false" if torch.cuda.is_available() else "ddp"
    return "auto"


def device_count(cfg: DictConfig) -> int:
    devices = cfg.trainer.devices
    if isinstance(devices, int):
        return devices
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if str(devices) == "auto" and cfg.trainer.accelerator != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def apply_global_batch(cfg: DictConfig) -> None:
    """trainer.global_batch_tokens -> accumulate_grad_batches (the 4M-token batch of the paper's 7B run)."""
    target = cfg.trainer.global_batch_tokens
    if target <= 0:
        return
    seq_len = int(OmegaConf.select(cfg, "data.options.seq_len") or cfg.data.max_length)
    per_step = cfg.data.batch_size * seq_len * device_count(cfg) * cfg.trainer.num_nodes
    accumulate = max(1, round(target / per_step))
    cfg.trainer.accumulate_grad_batches = accumulate
    print(
        f"[mega-suite] global batch {target} tokens = {per_step} tokens/step x {accumulate} accumulation "
        f"({per_step * accumulate} tokens)"
    )


def flops_per_token(mcfg) -> float:
    """Training matmul FLOPs per token: 6 x (non-embedding matmul parameters) + chunk attention (fwd + bwd)."""
    d, z, e, f = mcfg.model_dim, mcfg.z_dim, mcfg.value_dim, mcfg.ffn_hidden_dim
    block = d * z + 2 * d * e + d * d + e * d + (3 if mcfg.swiglu else 2) * d * f
    head = d * mcfg.vocab_size
    # Causal attention inside a chunk: on average C/2 keys per query, Q.K (Z) and P.V (E), 2 FLOPs each.
    attention = 2 * (z + e) * mcfg.chunk_size / 2
    return 6 * (mcfg.num_layers * block + head) + 3 * mcfg.num_layers * attention


def build_trainer(
    cfg: DictConfig, run_dir: Path, extra_callbacks: list | None = None, flops: float = 0.0
) -> L.Trainer:
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    t = cfg.trainer
    ckpt_dir = run_dir / "checkpoints"
    checkpoint = ModelCheckpoint(
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
        Throughput(t.log_every_n_steps, flops, t.peak_tflops),
        GracefulStop(ckpt_dir / "last.ckpt"),
        LearningRateMonitor(logging_interval="step"),
    ]
    callbacks.append(StepProgressBar() if t.progress_bar else LogLines(t.log_every_n_steps))
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
        accumulate_grad_batches=t.accumulate_grad_batches,
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


def run(cfg: DictConfig, extra_callbacks: list | None = None) -> dict[str, Any]:
    """Execute a resolved configuration. Returns the final metrics (and the run directory)."""
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    run_dir, resume_ckpt = resolve_run(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run_dir = str(run_dir)
    text = to_yaml(cfg)
    print(text)
    name = "config.yaml" if resume_ckpt is None else f"config.resumed-{time.strftime('%Y%m%d-%H%M%S')}.yaml"
    (run_dir / name).write_text(text)
    print(f"[mega-suite] run directory: {run_dir}" + (f" (resuming {resume_ckpt})" if resume_ckpt else ""))

    dm = build_datamodule(cfg)
    dm.prepare_data()
    mcfg = model_config_for(cfg, dm)
    apply_global_batch(cfg)
    module = build_module(
        cfg.task,
        mcfg,
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        trainer=OmegaConf.to_container(cfg.trainer, resolve=True),
        total_steps=cfg.trainer.max_steps,
    )
    if cfg.init_from:
        init_weights_from(module, cfg.init_from, resuming=resume_ckpt is not None, mode=cfg.mode)
    if cfg.trainer.compile:
        module.model = torch.compile(module.model)
    module.run_config = OmegaConf.to_container(cfg, resolve=True)
    flops = flops_per_token(mcfg) if cfg.task == "lm" else 0.0
    trainer = build_trainer(cfg, run_dir, extra_callbacks, flops)
    if trainer.logger is not None and resume_ckpt is None:
        trainer.logger.log_hyperparams(_flatten(module.run_config))
    data = ValWithTest(dm)
    if cfg.mode == "fit":
        try:
            trainer.fit(module, datamodule=data, ckpt_path=str(resume_ckpt) if resume_ckpt else None)
        except NonFiniteLossError as exc:
            print(f"[mega-suite] {exc}", file=sys.stderr)
            raise
        stopped = any(isinstance(cb, GracefulStop) and cb.requested for cb in trainer.callbacks)
        if not trainer.interrupted and not stopped:  # a graceful stop saved mid-epoch already: keep that
            trainer.save_checkpoint(run_dir / "checkpoints" / "last.ckpt")
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    elif cfg.mode in ("validate", "test"):
        ckpt = cfg.ckpt or (str(resume_ckpt) if resume_ckpt else None)
        if ckpt is None:
            raise ValueError(f"mode={cfg.mode} needs ckpt=PATH (or resume=auto / a run directory)")
        fn = trainer.validate if cfg.mode == "validate" else trainer.test
        out = fn(module, datamodule=data, ckpt_path=ckpt)
        metrics = {k: float(v) for d in out for k, v in d.items()}
    elif cfg.mode == "eval_context" and cfg.task == "lm":
        metrics = run_eval_context(cfg, module, dm, trainer, run_dir)
    else:
        raise ValueError(f"mode={cfg.mode!r} is not available for task {cfg.task!r}")
    metrics["run_dir"] = str(run_dir)
    return metrics


def init_weights_from(module, path: str, resuming: bool, mode: str) -> None:
    """Fine-tuning: the model weights of a suite checkpoint (``.ckpt``) or a reference state dict, loaded
    strictly (every name and shape must match); optimizer, schedule and step start afresh."""
    if mode != "fit":
        raise ValueError(f"init_from applies to mode=fit; for mode={mode} pass the checkpoint as ckpt=PATH")
    if resuming:
        print(f"[mega-suite] resuming: init_from={path} ignored (the resumed checkpoint has the weights)")
        return
    if not Path(path).is_file():
        raise FileNotFoundError(f"init_from={path}: no such checkpoint file")
    from mega_suite.checkpoint import load_reference_file

    try:
        load_reference_file(module.model, path)
    except ValueError as exc:
        raise ValueError(f"init_from={path}: {exc}") from None
    print(f"[mega-suite] model weights initialised from {path}")


def run_eval_context(cfg: DictConfig, module, dm, trainer, run_dir: Path) -> dict[str, Any]:
    """Validation perplexity against context length (figure 5 of the paper) from a checkpoint."""
    from mega_suite.evaluate import (
        default_context_lengths,
        documents_from_segments,
        eval_context,
        write_report,
    )

    if cfg.ckpt:
        state = torch.load(cfg.ckpt, map_location="cpu", weights_only=True)
        module.load_state_dict(state.get("state_dict", state))
    else:
        print("[mega-suite] eval_context without ckpt=PATH: evaluating the freshly initialised model")
    dm.setup("validate")
    docs = []
    for doc in documents_from_segments(dm.val_dataloader()):
        docs.append(doc)
        if cfg.eval_max_documents and len(docs) >= cfg.eval_max_documents:
            break
    if not docs:
        raise ValueError("eval_context: the validation split has no documents")
    longest = max(d.numel() for d in docs)
    lengths = list(cfg.eval_context_lengths) or default_context_lengths(longest)
    words = (getattr(dm, "num_words", None) or {}).get("val") if not cfg.eval_max_documents else None
    device = torch.device("cuda" if torch.cuda.is_available() and cfg.trainer.accelerator != "cpu" else "cpu")
    rows = eval_context(module.model.to(device), docs, lengths, num_words=words)
    writer = getattr(trainer.logger, "experiment", None)
    table, plot = write_report(rows, run_dir, writer)
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
