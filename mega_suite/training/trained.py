"""A trained model back from what training left (a checkpoint, a run directory or an exported bundle) with its
tokenizer, and the modes that use one: ``generate``, ``lm_eval``, ``passkey`` (docs/after_training.md). Also
the two things ``fit`` does for them: the tokenizer copied into the run directory, and the periodic
checkpoints of ``trainer.save_every_n_steps``.

The model of a checkpoint is built from the configuration of the run that wrote it (``config.yaml`` beside
``checkpoints/``) when there is one, else from the command's recipe; its vocabulary size from the weights. A
bundle carries its own configuration. The tokenizer: ``tokenizer=``, else the run directory's or bundle's
copy, else the data module's (``tokenizer_file``).
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from datamodules.tokenizer import TextTokenizer, copy_tokenizer, find_tokenizer
from mega_suite.config import ConfigError
from mega_suite.config.resolve import data_module, model_config
from mega_suite.config.schema import RunConfig
from mega_suite.evaluation.compare import CompareError
from mega_suite.evaluation.compare import tokens_per_step as from_config
from mega_suite.evaluation.generate import run_generate
from mega_suite.evaluation.passkey import run_passkey
from mega_suite.models import arch_of, build_model
from mega_suite.models.bundle import BundleError, is_bundle, load_bundle_into, read_config
from mega_suite.training.checkpoint import is_sharded_checkpoint, sharded_model_state, strip_prefixes

STEP_CHECKPOINT = re.compile(r"step(\d+)\.ckpt$")


@dataclass
class Trained:
    model: nn.Module
    tokenizer: TextTokenizer
    source: Path  # the checkpoint or bundle read
    step: int | None = None  # the optimizer step of a Lightning checkpoint
    tokens: int | None = (
        None  # training tokens seen at that step, when the run's config says how many per step
    )
    notes: list[str] = field(default_factory=list)

    @property
    def arch(self) -> str:
        return arch_of(self.model.cfg).name

    def context_note(self) -> str:
        """How the model sees long contexts, for reports."""
        c = self.model.cfg
        if self.arch == "llama":
            return (
                f"Llama, scored with its window: at most {c.max_seq_len} tokens (sliding window, stride {c.stride}: "
                f"each token sees {c.max_seq_len - c.stride} to {c.max_seq_len - 1} earlier tokens; context "
                "beyond the window is not seen)"
            )
        return f"{self.arch}: scored with its full context (streaming, chunk {getattr(c, 'chunk_size', '?')})"


def device_of(cfg: DictConfig) -> torch.device:
    use_gpu = torch.cuda.is_available() and cfg.trainer.accelerator != "cpu"
    return torch.device("cuda" if use_gpu else "cpu")


def checkpoint_path(path: str | Path) -> Path:
    """A bundle or checkpoint as given; a run directory -> its ``checkpoints/last.ckpt``."""
    path = Path(path)
    if is_bundle(path) or is_sharded_checkpoint(path) or path.is_file():
        return path
    if path.is_dir():
        last = path / "checkpoints" / "last.ckpt"
        if last.exists():
            return last
        if (path / "config.json").is_file():
            return path  # a bundle without weights: read_config / load name what is missing
        raise FileNotFoundError(f"{path}: neither a bundle nor a run directory with checkpoints/last.ckpt")
    raise FileNotFoundError(f"{path}: no such checkpoint, run directory or bundle")


def run_dir_of(path: Path) -> Path | None:
    """The run directory a checkpoint lies in (``<run>/checkpoints/<ckpt>``), if it is one."""
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        return path.parent.parent
    return None


def run_config_of(run_dir: Path | None, fallback: DictConfig) -> tuple[DictConfig, str]:
    """The configuration of the run that wrote a checkpoint (its ``config.yaml``), else ``fallback``."""
    if run_dir is None:
        return fallback, "the command's recipe"
    try:
        written = OmegaConf.load(run_dir / "config.yaml")
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), written)
        OmegaConf.set_readonly(cfg, False)
        data_module(cfg)  # its data section must still resolve (the Llama window is the data's seq_len)
        return cfg, f"{run_dir / 'config.yaml'}"
    except Exception as exc:  # an older or hand-edited config.yaml: say so and use the command's
        print(f"[mega-suite] {run_dir / 'config.yaml'} not usable ({exc}); using the command's recipe")
        return fallback, "the command's recipe"


def checkpoint_state(path: Path) -> tuple[OrderedDict[str, Tensor], int | None]:
    """Model weights (reference names) and the optimizer step of a checkpoint file or sharded directory."""
    if is_sharded_checkpoint(path):
        step = None
        meta = path / "meta.pt"
        if meta.is_file():
            step = torch.load(meta, map_location="cpu", weights_only=True).get("global_step")
        return sharded_model_state(path), step
    obj = torch.load(path, map_location="cpu", weights_only=True)
    step = None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        step = obj.get("global_step")
        obj = {k: v for k, v in obj["state_dict"].items() if k.startswith("model.")}
    elif isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}: not a checkpoint (expected a state dict, a suite checkpoint or a bundle)")
    return OrderedDict((strip_prefixes(k), v) for k, v in obj.items()), step


def tokens_per_step(run_dir: Path | None) -> int | None:
    if run_dir is None:
        return None
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        return from_config(config, run_dir)[0]
    except (CompareError, OSError, yaml.YAMLError):
        return None


def tokenizer_for(cfg: DictConfig, *places: Path | None) -> TextTokenizer:
    """``tokenizer=``; else the first of ``places`` (a run directory or bundle) holding a copy; else the data
    module's tokenizer file."""
    if cfg.tokenizer:
        return TextTokenizer(cfg.tokenizer, source="tokenizer")
    for place in places:
        found = find_tokenizer(place) if place is not None else None
        if found is not None:
            return TextTokenizer(found, source="the run's tokenizer")
    cls, kwargs = data_module(cfg)
    dm = cls(**kwargs)
    path = getattr(dm, "tokenizer_file", None)
    if path is None:
        raise FileNotFoundError(
            f"no tokenizer: {', '.join(str(p) for p in places if p) or 'the checkpoint'} holds none and "
            f"data.name={cfg.data.name!r} has no tokenizer file; give tokenizer=PATH (a SentencePiece .model or "
            "a tokenizer.json)"
        )
    return TextTokenizer(path, source=f"data.options.tokenizer_path of recipe {cfg.recipe}")


def load_trained(cfg: DictConfig, path: str | Path) -> Trained:
    """The model (eval mode, on the run's device) and tokenizer of a checkpoint, run directory or bundle."""
    source = checkpoint_path(path)
    device = device_of(cfg)
    if source.is_dir() and (source / "config.json").is_file():
        try:
            model = build_model(read_config(source))
            load_bundle_into(model, source)
        except BundleError as exc:
            raise ConfigError(f"ckpt={path}: {exc}") from None
        tokenizer = tokenizer_for(cfg, source)
        trained = Trained(model, tokenizer, source, notes=[f"model: the bundle's config.json ({source})"])
    else:
        run_dir = run_dir_of(source)
        run_cfg, origin = run_config_of(run_dir, cfg)
        state, step = checkpoint_state(source)
        updates = {"vocab_size": int(state["embed.weight"].shape[0])} if "embed.weight" in state else {}
        try:  # strictly: a RuntimeError names every missing, unexpected or mis-shaped tensor
            model = build_model(model_config(run_cfg, **updates))
            state.pop("rope.freqs", None)  # the reference release's buffer; ours are derived from the config
            model.load_state_dict(state, strict=True)
        except (ValueError, RuntimeError) as exc:
            raise ConfigError(f"ckpt={path} does not fit the model of {origin}: {exc}") from None
        tokenizer = tokenizer_for(cfg, run_dir, source.parent)
        per_step = tokens_per_step(run_dir)
        tokens = step * per_step if step is not None and per_step else None
        trained = Trained(model, tokenizer, source, step, tokens, [f"model: {origin}"])
    vocab = trained.model.cfg.vocab_size
    if trained.tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"tokenizer {trained.tokenizer.path} has {trained.tokenizer.vocab_size} pieces, more than the model's "
            f"vocabulary of {vocab}: not the tokenizer it was trained with (give tokenizer=PATH)"
        )
    trained.model.to(device).eval()
    return trained


def step_checkpoints(path: str | Path) -> list[Path]:
    """The periodic checkpoints of a run directory (``checkpoints/step<N>.ckpt``), by step."""
    folder = Path(path) / "checkpoints"
    found = [(int(m.group(1)), p) for p in folder.glob("step*.ckpt") if (m := STEP_CHECKPOINT.search(p.name))]
    if not found:
        raise FileNotFoundError(
            f"{path}: no periodic checkpoints (checkpoints/step<N>.ckpt); train with trainer.save_every_n_steps=N"
        )
    return [p for _, p in sorted(found)]


# --------------------------------------------------------------------------------------------------------------
# what fit does for the modes above
# --------------------------------------------------------------------------------------------------------------


def save_run_tokenizer(dm: Any, run_dir: Path) -> Path | None:
    """Copy the data module's tokenizer file into the run directory (a run directory is self-contained)."""
    path = getattr(dm, "tokenizer_file", None)
    if path is None or not Path(path).is_file():
        return None
    return copy_tokenizer(path, run_dir)


def periodic_checkpoint(cfg: DictConfig, ckpt_dir: Path):
    """A ModelCheckpoint writing ``checkpoints/step<N>.ckpt`` every ``trainer.save_every_n_steps`` steps and
    keeping the newest ``trainer.keep_checkpoints`` (all when 0); None when off."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    t = cfg.trainer
    if not t.save_every_n_steps:
        return None
    return ModelCheckpoint(
        dirpath=ckpt_dir,
        filename="step{step:07d}",
        auto_insert_metric_name=False,
        every_n_train_steps=t.save_every_n_steps,
        monitor="step",
        mode="max",
        save_top_k=t.keep_checkpoints or -1,
        save_last=False,
    )


# --------------------------------------------------------------------------------------------------------------
# the modes
# --------------------------------------------------------------------------------------------------------------


def run_after_training(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """mode=generate | lm_eval | passkey in ``run_dir``."""
    torch.manual_seed(cfg.seed)
    if cfg.mode == "generate":
        return run_generate(cfg, load_trained(cfg, cfg.ckpt), run_dir)
    if cfg.mode == "lm_eval":
        from mega_suite.evaluation.harness import run_lm_eval  # imports lm-evaluation-harness: only here

        sources = [cfg.ckpt] if cfg.ckpt else list(cfg.lm_eval.checkpoints)
        if len(sources) == 1 and not cfg.ckpt and Path(sources[0]).is_dir() and not is_bundle(sources[0]):
            sources = step_checkpoints(sources[0])  # a run directory: every periodic checkpoint
        return run_lm_eval(cfg, [lambda s=s: load_trained(cfg, s) for s in sources], run_dir)
    if cfg.mode == "passkey":
        return run_passkey(cfg, load_trained(cfg, cfg.ckpt), run_dir)
    raise ConfigError(f"mode={cfg.mode!r} does not use a trained model")


def announce(text: str) -> None:
    sys.stdout.write(f"[mega-suite] {text}\n")
    sys.stdout.flush()
