"""Exporting and consolidating a trained model (``mega-suite export`` / ``consolidate``;
docs/after_training.md#shareable-weights).

Both read their source through the one checkpoint reader (a run folder, a Lightning checkpoint, a sharded
FSDP2 folder, a consolidated state dict or a bundle) and write through ``new_output``: the result is built
under a temporary name beside its destination and renamed into place when complete. A destination that
exists is refused unless ``overwrite`` is given and it is of the same kind (a bundle by a bundle, a torch file
by a torch file); a destination inside a run folder is always refused (a run holds what training wrote).

An export rebuilds the model from the configuration of the run that wrote the checkpoint (its
``config.yaml``, else the configuration saved in the checkpoint), loads it strictly and writes it with its
tokenizer (``mega_suite.models.bundle``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from mega_suite.config import ConfigError
from mega_suite.config.schema import RunConfig
from mega_suite.models.bundle import DTYPES, is_bundle, save_bundle
from mega_suite.storage.atomic import new_output
from mega_suite.storage.checkpoints import open_checkpoint
from mega_suite.storage.runs import enclosing_run
from mega_suite.training.trained import file_digest, load_trained


def _outside_runs(out: Path, key: str) -> None:
    inside = enclosing_run(out) if not out.exists() else (out if _is_run(out) else enclosing_run(out))
    if inside is not None:
        raise ConfigError(f"{key}={out} lies in the run {inside}; write it outside any run folder")


def _is_run(path: Path) -> bool:
    from mega_suite.storage.checkpoints import is_run_folder

    return is_run_folder(path)


def _empty_folder(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def export(
    source: str | Path,
    out_dir: str | Path,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write the bundle of ``source`` (a run folder, a checkpoint or a bundle) into ``out_dir``."""
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: expected one of {', '.join(sorted(DTYPES))}")
    out = Path(out_dir).expanduser()
    checkpoint = open_checkpoint(Path(source).expanduser(), "SOURCE")
    _outside_runs(out, "OUT")
    if out.exists() and not (_empty_folder(out) or is_bundle(out)):
        raise ConfigError(
            f"OUT={out} exists and is not a bundle; an export writes a new folder (or replaces a bundle with "
            "--overwrite), never into a folder of other files"
        )
    cfg = OmegaConf.structured(RunConfig)
    OmegaConf.set_readonly(cfg, False)
    cfg.trainer.accelerator = "cpu"
    trained = load_trained(cfg, checkpoint)
    tok = trained.tokenizer
    extra = {
        "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "source_checkpoint": str(trained.source),
        "tokenizer_digest": file_digest(tok.path),
    }  # fmt: skip
    if trained.step is not None:
        extra["step"] = trained.step
    if trained.tokens is not None:
        extra["training_tokens"] = trained.tokens
    if _empty_folder(out):
        out.rmdir()  # an empty folder is as good as none
    with new_output(out, "OUT", folder=True, overwrite=overwrite, same_kind=is_bundle) as tmp:
        save_bundle(
            trained.model, tmp, tokenizer=tok.path, dtype=DTYPES[dtype] if dtype else None,
            max_shard_size=max_shard_size, extra=extra,
        )  # fmt: skip
    return out


def _torch_file(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def consolidate(source: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the model weights of a run folder (its newest checkpoint) or of one checkpoint, sharded or not,
    as one reference-format state dict file (``torch.save``) that every ``ckpt=`` and ``init_from=`` reads."""
    out = Path(out).expanduser()
    checkpoint = open_checkpoint(Path(source).expanduser(), "SOURCE")
    _outside_runs(out, "OUT")
    if out.is_dir():
        raise ConfigError(f"OUT={out} is a folder; consolidate writes one file (e.g. {out / 'model.pt'})")
    state = checkpoint.state()
    with new_output(out, "OUT", folder=False, overwrite=overwrite, same_kind=_torch_file) as tmp:
        torch.save(state, tmp)
    return out
