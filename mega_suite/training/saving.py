"""Which checkpoints a run writes, and when (docs/configuration.md#checkpoints).

``SuiteCheckpoint`` is Lightning's ``ModelCheckpoint`` made the one writer of a run's checkpoints:

- ``last.ckpt`` is written through it alone (after every validation, on a stop request, at the end of the
  fit: ``save_last``), so it knows the file is its own and never puts a ``last-vN.ckpt`` beside it. (Its
  ``on_train_end`` saved "last" again when it had not written one itself: after a stop before the first
  validation that made ``last-v1.ckpt``, written at the end of the loop, from which a resume was not exact.
  And it wrote "last" only at validations that improved on the best checkpoint.)
- A checkpoint is good only if the model is finite and its validation, when one ran, was finite: a
  non-finite validation saves nothing and stops the run (``NonFiniteLossError``); no diverged weights ever
  replace ``last.ckpt`` or become ``best-*.ckpt``.
- After every write it asks the stop callback (``GracefulStop.after_save``) whether a stop was requested
  meanwhile, so a signal that arrives during a save stops the run at that save's step.

A failed write is a ``CheckpointSaveError`` (``AtomicCheckpointIO``): one line naming the file and why (disk
full, read-only), the partial file removed, the previous checkpoint kept.

No weights are stored twice: ``last.ckpt`` written at the step of a new best checkpoint is a hard link to it,
and the end of a fit does not write ``last.ckpt`` again when it already holds the final step, so a run keeps
its best checkpoint, ``last.ckpt`` and the previous generation ``last.ckpt.prev``, each once.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from mega_suite.storage.atomic import keep_previous, remove_path
from mega_suite.training.errors import CheckpointSaveError, NonFiniteLossError

__all__ = [
    "AtomicCheckpointIO", "CheckpointSaveError", "NonFiniteLossError", "SuiteCheckpoint", "save_error", "save_last",
    "why",
]  # fmt: skip


_REASONS = {
    errno.ENOSPC: "the disk is full (no space left on device)",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def why(exc: OSError) -> str:
    """An OSError in a few words: disk full, read-only, permission denied, ... (else its own message)."""
    return _REASONS.get(exc.errno, exc.strerror or str(exc))


def save_error(path: Path, exc: OSError) -> CheckpointSaveError:
    previous = f"; the previous {path.name} is kept" if Path(path).exists() else ""
    error = CheckpointSaveError(
        f"cannot write checkpoint {path}: {why(exc)}{previous}; free space or set run_root= to a writable "
        "folder, then resume with resume=auto"
    )
    error.errno = exc.errno
    return error


def weights_finite(trainer, pl_module) -> bool:
    """Whether every parameter (this rank's shards) is finite, agreed over all ranks."""
    flags = [
        (~torch.isfinite(local)).any()
        for p in pl_module.parameters()
        for local in [p.to_local() if hasattr(p, "to_local") else p]
        if local.is_floating_point() and local.numel()
    ]
    bad = torch.stack(flags).any().float() if flags else torch.zeros((), device=pl_module.device)
    if trainer.world_size > 1:
        bad = trainer.strategy.reduce(bad.to(pl_module.device), reduce_op="max")
    return not bool(bad)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to ``<path>.tmp``, then rename: a kill during the save never leaves a corrupt checkpoint. The
    checkpoint it replaces stays as ``<path>.prev`` (one generation back: the fallback of ``resume=auto``
    when the newest cannot be read). A failed write removes its ``.tmp`` and raises ``CheckpointSaveError``
    (one line: which file, and why). Checkpoints hold only tensors and plain Python values, and load with
    ``weights_only=True``."""

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


class SuiteCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (best by ``monitor`` and ``last.ckpt``) that writes only good checkpoints and owns
    ``last.ckpt`` (see the module docstring)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("save_last", True)
        super().__init__(enable_version_counter=False, **kwargs)
        self._last_step: int | None = None  # the step last.ckpt holds, as this process wrote it
        self._best_step: int | None = None  # the step of the best checkpoint this process wrote

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self._should_skip_saving_checkpoint(trainer):
            bad = {
                key: float(value)
                for key, value in trainer.callback_metrics.items()
                if key.startswith(("val/", "test/")) and not math.isfinite(float(value))
            }
            if bad:
                values = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
                raise NonFiniteLossError(
                    f"non-finite validation ({values}) at step {trainer.global_step}; stopping without saving it."
                )
        super().on_validation_end(trainer, pl_module)
        # Lightning writes "last" only at a step that also saved a best checkpoint: last.ckpt would lag behind
        # every validation that did not improve on the best (a crash then loses those steps).
        if not self._should_skip_saving_checkpoint(trainer) and not self._should_save_on_train_epoch_end(
            trainer
        ):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        if not weights_finite(trainer, trainer.lightning_module):
            raise NonFiniteLossError(
                f"the model's weights hold NaN/inf at step {trainer.global_step}; stopping without saving them."
            )
        super()._save_checkpoint(trainer, filepath)
        for callback in trainer.callbacks:
            after_save = getattr(callback, "after_save", None)
            if after_save is not None:
                after_save(trainer, trainer.lightning_module)

    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        """``last.ckpt`` of this step: a hard link to the best checkpoint when that was just written at the same
        step (one copy of the weights, not two); nothing when it already holds this step."""
        if not self.save_last or self._last_step == trainer.global_step:
            return
        last = Path(self.dirpath) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
        best = Path(self.best_model_path) if self.best_model_path else None
        same_step = (
            best is not None
            and best.is_file()
            and trainer.is_global_zero
            and self._best_step == trainer.global_step
        )
        if same_step and trainer.world_size == 1:
            tmp = last.with_name(last.name + ".tmp")
            remove_path(tmp)
            os.link(best, tmp)
            keep_previous(last)
            os.replace(tmp, last)
            self.last_model_path = str(last)
        else:
            super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_step = trainer.global_step

    def _update_best_and_save(self, current, trainer, monitor_candidates) -> None:
        before = self.best_model_path
        super()._update_best_and_save(current, trainer, monitor_candidates)
        if self.best_model_path != before:
            self._best_step = trainer.global_step

    def write_last(self, trainer) -> None:
        """Write ``last.ckpt`` now (a stop request, the end of the fit), unless it holds this step already."""
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


def save_last(trainer, fallback: Path) -> None:
    """``last.ckpt`` through the run's ``SuiteCheckpoint``; ``fallback`` where a trainer has none."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, SuiteCheckpoint):
            callback.write_last(trainer)
            return
    trainer.save_checkpoint(fallback)
