"""State dicts in the reference release's format.

Our module tree uses the reference names natively (``layers.{i}.mega.{timenorm,cema,rmsnorm,wz,wv,wr,
wh1,wh2,gamma,beta}.*``, ``layers.{i}.nffn.{norm,fc1,fc2,fc3}.*``, ``embed.weight``, ``output.final_norm.*``,
``output.output.weight``; CEMA ``alpha delta theta gamma omega``; TimestepNorm buffers ``prior_count
prior_mean prior_logv``), so conversion is a checked identity: these functions validate names and shapes
and fail loudly, naming every missing, unexpected or mis-shaped key.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from mega_suite.models.bundle import bundle_state, is_bundle
from mega_suite.models.common import state_mismatch
from mega_suite.training.saving import save_error

# Wrappers that training frameworks put in front of names (torch.compile, DDP, Lightning modules, and the
# "state_dict." of a sharded checkpoint's keys).
_PREFIXES = ("_orig_mod.", "module.", "model.", "state_dict.")


def strip_prefixes(key: str) -> str:
    """A parameter's reference name: the wrappers' prefixes removed."""
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix) :], True
    return key


def to_reference(model: nn.Module) -> OrderedDict[str, Tensor]:
    """Our model -> a reference-format state dict (detached tensors, names unchanged)."""
    return OrderedDict((strip_prefixes(k), v.detach()) for k, v in model.state_dict().items())


# The release keeps RoPE's inverse frequencies as a buffer; ours are computed from model.rope_base.
_DERIVED = ("rope.freqs",)


def _check_rope(freqs: Tensor, model: nn.Module | None) -> None:
    cfg = getattr(model, "cfg", None)
    if cfg is None or freqs.dim() != 1:
        return
    d = cfg.z_dim // cfg.num_heads
    ours = cfg.rope_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    if freqs.numel() == ours.numel() and not torch.allclose(freqs.double(), ours, rtol=1e-4):
        raise ValueError(
            f"checkpoint rope.freqs do not match model.rope_base={cfg.rope_base}; set rope_base to the "
            "checkpoint's base (the paper's 7B used 100000)"
        )


def from_reference(state_dict: dict[str, Tensor], model: nn.Module | None = None) -> OrderedDict[str, Tensor]:
    """A reference-format state dict -> ours. With ``model``, check every key and shape against it.

    Buffers the release stores but we derive from the config (``rope.freqs``) are checked and dropped.
    """
    out = OrderedDict((strip_prefixes(k), v) for k, v in state_dict.items())
    for key in _DERIVED:
        if key in out:
            _check_rope(out.pop(key), model)
    problem = None if model is None else state_mismatch(out, model, "checkpoint")
    if problem:
        raise ValueError(f"reference state dict does not match the model: {problem}")
    return out


def load_reference(model: nn.Module, state_dict: dict[str, Tensor]) -> nn.Module:
    """Load a reference-format state dict strictly (no missing or unexpected keys)."""
    model.load_state_dict(from_reference(state_dict, model), strict=True)
    return model


def load_reference_file(model: nn.Module, path: str) -> nn.Module:
    """Load a checkpoint file's model weights strictly: ``torch.save`` of a state dict, a dict with a
    "model" entry, one of the suite's Lightning checkpoints (the ``model.`` entries of "state_dict"), or a
    sharded (torch.distributed.checkpoint) checkpoint directory of ``trainer.strategy=fsdp``."""
    if is_sharded_checkpoint(path):
        return load_reference(model, sharded_model_state(path))
    if is_bundle(path):  # python -m mega_suite.training.checkpoint export
        return load_reference(model, bundle_state(path))
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = {k: v for k, v in obj["state_dict"].items() if k.startswith("model.")}
    elif isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        obj = obj["model"]
    return load_reference(model, obj)


# --------------------------------------------------------------------------------------------------------------
# Sharded (torch.distributed.checkpoint) checkpoints of trainer.strategy=fsdp / hsdp
# --------------------------------------------------------------------------------------------------------------


def is_sharded_checkpoint(path) -> bool:
    """A directory written by torch.distributed.checkpoint (Lightning's ModelParallelStrategy): ``.metadata``
    plus one ``__R_0.distcp`` shard per rank and the trainer state in ``meta.pt``."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def sharded_model_state(path) -> OrderedDict[str, Tensor]:
    """The full model weights of a sharded checkpoint, in reference format, read on one process (no process
    group: ``dcp_to_torch_save`` reads every shard)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(path), str(out))
        state = torch.load(out, map_location="cpu", weights_only=True)
    model = {k: v for k, v in state["state_dict"].items() if k.startswith("model.")}
    return OrderedDict((strip_prefixes(k), v) for k, v in model.items())


def _checkpoint_of(path) -> Path:
    path = Path(path)
    if path.is_dir() and not is_sharded_checkpoint(path):
        path = path / "checkpoints" / "last.ckpt"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint (expected a run directory or a checkpoint)")
    return path


def is_lightning_checkpoint(path) -> bool:
    """A suite Lightning checkpoint (sharded directory, or a file with "state_dict") rather than model weights
    alone in reference format."""
    if is_sharded_checkpoint(path):
        return True
    if is_bundle(path):
        return False
    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict)


def consolidate(source, out) -> Path:
    """Write the model weights of a run directory (its ``checkpoints/last.ckpt``) or of one checkpoint, sharded
    or not, as one reference-format state dict file (``torch.save``) that ``load_reference_file`` reads."""
    path = _checkpoint_of(source)
    if is_sharded_checkpoint(path):
        state = sharded_model_state(path)
    else:
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(obj.get("state_dict"), dict):  # a Lightning checkpoint: the model's entries
            obj = {k: v for k, v in obj["state_dict"].items() if k.startswith("model.")}
        state = OrderedDict((strip_prefixes(k), v) for k, v in obj.items())
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out)
    return out


# ----------------------------------------------------------------------------------------------------------
# Atomic writes
# ----------------------------------------------------------------------------------------------------------


PREVIOUS = ".prev"  # the checkpoint a save replaced, kept until the next save: one generation back


def previous_of(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + PREVIOUS)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to ``<path>.tmp``, then rename: a kill during the save never leaves a corrupt checkpoint. The
    checkpoint it replaces stays as ``<path>.prev`` (one generation back: the fallback of ``resume=auto``
    when the newest cannot be read). A failed write removes its ``.tmp`` and raises ``CheckpointSaveError``
    (one line: which file, and why).

    Checkpoints hold only tensors and plain Python values, and load with ``weights_only=True``.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            super().save_checkpoint(checkpoint, tmp, storage_options)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            keep_previous(path)
            os.replace(tmp, path)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                remove_path(tmp)
            if isinstance(exc, OSError):
                raise save_error(path, exc) from None
            if isinstance(exc, RuntimeError) and "No space left" in str(exc):  # torch's zip writer
                raise save_error(path, OSError(errno.ENOSPC, "No space left on device")) from None
            raise

    def load_checkpoint(self, path, map_location=None, **kwargs) -> dict[str, Any]:
        if not Path(path).exists():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


def keep_previous(path: Path, move: bool = False) -> None:
    """Before ``path`` is replaced: its current content becomes ``<path>.prev`` (a hard link where the file
    system has them, so that ``path`` itself never disappears; a rename otherwise, or with ``move``)."""
    path = Path(path)
    if not path.exists():
        return
    prev = previous_of(path)
    remove_path(prev)
    if path.is_file() and not move:
        try:
            os.link(path, prev)
            return
        except OSError:
            pass
    os.replace(path, prev)


def replace_checkpoint(tmp: Path, path: Path) -> None:
    """Put the finished checkpoint ``tmp`` (file or sharded directory) at ``path``. A directory cannot be
    replaced in one rename: the previous one moves to ``<path>.prev`` first (kept, one generation back), so
    a kill at any moment leaves ``path`` or ``<path>.prev`` whole (``resume=auto`` falls back to it)."""
    tmp, path = Path(tmp), Path(path)
    keep_previous(path, move=tmp.is_dir() or path.is_dir())
    os.replace(tmp, path)


def recover_checkpoint(path: Path) -> Path:
    """A save killed between the two renames of an older ``replace_checkpoint`` left only ``<path>.old``:
    put it back. (Now the previous one is ``<path>.prev``, which ``resume=auto`` reads where ``path`` is
    missing.)"""
    path = Path(path)
    old = path.with_name(path.name + ".old")
    if not path.exists() and old.exists():
        os.replace(old, path)
        print(
            f"[mega-suite] {path}: an interrupted save left the previous checkpoint in {old.name}; restored"
        )
    return path


def remove_path(path: Path) -> None:
    """Delete a file or a sharded checkpoint directory, if present."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def load_full_weights(model: nn.Module, path) -> None:
    """Load a checkpoint's model weights (any format ``load_reference_file`` reads) into a sharded model:
    rank 0 reads and checks the file, and ``set_model_state_dict`` broadcasts each tensor and keeps every
    rank's shard (``broadcast_from_rank0``), so the other ranks never hold the whole model."""
    if not (dist.is_available() and dist.is_initialized()):
        load_reference_file(model, path)
        return
    state = {}
    if dist.get_rank() == 0:
        if is_sharded_checkpoint(path):
            raw = sharded_model_state(path)
        elif is_bundle(path):
            raw = bundle_state(path)
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(raw, dict) and isinstance(raw.get("state_dict"), dict):
                raw = {k: v for k, v in raw["state_dict"].items() if k.startswith("model.")}
            elif isinstance(raw, dict) and isinstance(raw.get("model"), dict):
                raw = raw["model"]
        state = dict(from_reference(raw, model))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)


if __name__ == "__main__":  # the command line is export.py's (it reads trained runs: above this module)
    from mega_suite.training.export import main

    raise SystemExit(main())
