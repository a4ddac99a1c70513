"""A trained model back from a checked checkpoint (``mega_suite.storage.checkpoints``) with its tokenizer, and
the modes that use one: ``generate``, ``lm_eval``, ``passkey`` (docs/after_training.md). Also the two things
``fit`` does for them: the tokenizer copied into the run folder, and the periodic checkpoints of
``trainer.save_every_n_steps``.

The model of a checkpoint is built from the configuration of the run that wrote it (its ``config.yaml``, else
the configuration saved in the checkpoint) when there is one, else from the command's recipe; its
vocabulary size from the weights. A bundle carries its own configuration. The tokenizer: ``tokenizer=``, else
the run folder's or bundle's copy, else the data module's.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from datamodules.tokenizer import TextTokenizer, copy_tokenizer, find_tokenizer
from mega_suite.config import ConfigError
from mega_suite.config.resolve import data_module, model_config, tokens_per_step
from mega_suite.config.schema import RunConfig
from mega_suite.evaluation.generate import run_generate
from mega_suite.evaluation.passkey import run_passkey
from mega_suite.models import arch_of, build_model
from mega_suite.models.bundle import BundleError, read_config
from mega_suite.storage.checkpoints import Checkpoint, from_reference


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
        """How the model sees long contexts, for reports (its architecture's words)."""
        return arch_of(self.model.cfg).context_note(self.model.cfg)


def device_of(cfg: DictConfig) -> torch.device:
    use_gpu = torch.cuda.is_available() and cfg.trainer.accelerator != "cpu"
    return torch.device("cuda" if use_gpu else "cpu")


def file_digest(path: str | Path) -> str:
    """sha256 of a file (a tokenizer: what a resume compares)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_config_of(checkpoint: Checkpoint, fallback: DictConfig) -> tuple[DictConfig, str]:
    """The configuration of the run that wrote a checkpoint: its run folder's ``config.yaml``, else the one
    saved in the checkpoint, else ``fallback`` (the command's)."""
    run_dir = checkpoint.run_dir
    sources = []
    if run_dir is not None and (run_dir / "config.yaml").is_file():
        sources.append((lambda: OmegaConf.load(run_dir / "config.yaml"), str(run_dir / "config.yaml")))
    if checkpoint.run_config:
        sources.append(
            (lambda: OmegaConf.create(checkpoint.run_config), f"the configuration saved in {checkpoint.path}")
        )
    for read, origin in sources:
        try:
            cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), read())
            OmegaConf.set_readonly(cfg, False)
            data_module(cfg)  # its data section must still resolve (the Llama window is the data's seq_len)
            return cfg, origin
        except Exception as exc:  # noqa: BLE001  (an older or hand-edited configuration: say so, try the next)
            print(f"[mega-suite] {origin} not usable ({' '.join(str(exc).split())[:160]}); trying the next")
    return fallback, "the command's recipe"


def tokenizer_for(cfg: DictConfig, given: Path | None, *places: Path | None) -> TextTokenizer:
    """``tokenizer=``; else the first of ``places`` (a run folder or bundle) holding a copy; else the data
    module's tokenizer file."""
    if given is not None:
        return TextTokenizer(given, source="tokenizer")
    for place in places:
        found = find_tokenizer(place) if place is not None else None
        if found is not None:
            return TextTokenizer(found, source="the run's tokenizer")
    cls, kwargs = data_module(cfg)
    path = getattr(cls(**kwargs), "tokenizer_file", None)
    if path is None:
        raise ConfigError(
            f"no tokenizer: {', '.join(str(p) for p in places if p) or 'the checkpoint'} holds none and "
            f"data.name={cfg.data.name!r} has no tokenizer file; give tokenizer=PATH (a SentencePiece .model or "
            "a tokenizer.json)"
        )
    return TextTokenizer(path, source=f"data.options.tokenizer_path of recipe {cfg.recipe}")


def load_trained(cfg: DictConfig, checkpoint: Checkpoint, tokenizer: Path | None = None) -> Trained:
    """The model (eval mode, on the run's device) and tokenizer of a checked checkpoint or bundle."""
    where = f"ckpt={checkpoint.path}"
    if checkpoint.format == "bundle":
        try:
            model = build_model(read_config(checkpoint.path))
        except BundleError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        state, origin, run_cfg, run_dir = (
            checkpoint.state(),
            f"the bundle's config.json ({checkpoint.path})",
            cfg,
            None,
        )
    else:
        run_cfg, origin = run_config_of(checkpoint, cfg)
        state = checkpoint.state()
        updates = {"vocab_size": int(state["embed.weight"].shape[0])} if "embed.weight" in state else {}
        model = build_model(model_config(run_cfg, **updates))
        run_dir = checkpoint.run_dir
    try:  # strictly: the message names every missing, unexpected or mis-shaped tensor
        model.load_state_dict(from_reference(state, model), strict=True)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(
            f"{where} does not fit the model of {origin}: {' '.join(str(exc).split())[:400]}"
        ) from None
    places = (checkpoint.path,) if checkpoint.format == "bundle" else (run_dir, checkpoint.path.parent)
    tok = tokenizer_for(run_cfg, tokenizer, *places)
    vocab = model.cfg.vocab_size
    if tok.vocab_size > vocab:
        raise ConfigError(
            f"tokenizer {tok.path} has {tok.vocab_size} pieces, more than the model's vocabulary of {vocab}: not "
            "the tokenizer it was trained with (give tokenizer=PATH)"
        )
    tokens = None
    if checkpoint.global_step is not None and checkpoint.format != "bundle" and run_cfg is not cfg:
        per_step = tokens_per_step(run_cfg)
        tokens = int(checkpoint.global_step * per_step[0]) if per_step and run_cfg.task == "lm" else None
    model.to(device_of(cfg)).eval()
    return Trained(model, tok, checkpoint.path, checkpoint.global_step, tokens, [f"model: {origin}"])


# --------------------------------------------------------------------------------------------------------------
# what fit does for the modes above
# --------------------------------------------------------------------------------------------------------------


def save_run_tokenizer(dm: Any, run_dir: Path) -> Path | None:
    """Copy the data module's tokenizer file into the run folder (a run folder is self-contained)."""
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


def load_evaluated(plan) -> list:
    """The models an after-training mode reads, as loaders: the first loaded and checked now (its model and
    tokenizer), before the mode's folder is created; the others (lm_eval over several checkpoints) checked
    against its tensors now and loaded one at a time when scored."""
    first = load_trained(plan.cfg, plan.evaluated[0], plan.tokenizer)
    ours = {k: tuple(v.shape) for k, v in first.model.state_dict().items() if k != "rope.freqs"}
    for other in plan.evaluated[1:]:
        theirs = {k: v for k, v in other.shapes.items() if k != "rope.freqs"}
        if theirs != ours:
            raise ConfigError(
                f"lm_eval.checkpoints: {other.path} holds another model than {first.source} (the checkpoints of "
                "one curve must be of one model)"
            )
    rest = [lambda c=c: load_trained(plan.cfg, c, plan.tokenizer) for c in plan.evaluated[1:]]
    return [lambda: first, *rest]


def run_after_training(plan, loaders: list, folder: Path) -> dict[str, Any]:
    """mode=generate | lm_eval | passkey, writing into ``folder``."""
    cfg = plan.cfg
    torch.manual_seed(cfg.seed)
    if cfg.mode == "generate":
        return run_generate(cfg, loaders[0](), folder, plan.prompt)
    if cfg.mode == "lm_eval":
        from mega_suite.evaluation.harness import run_lm_eval  # imports lm-evaluation-harness: only here

        return run_lm_eval(cfg, loaders, folder)
    if cfg.mode == "passkey":
        return run_passkey(cfg, loaders[0](), folder)
    raise ConfigError(f"mode={cfg.mode!r} does not use a trained model")


def announce(text: str) -> None:
    sys.stdout.write(f"[mega-suite] {text}\n")
    sys.stdout.flush()
