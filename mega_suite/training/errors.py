"""The errors a run reports in one line (``run.py``), importable without torch or Lightning."""

from __future__ import annotations


class NonFiniteLossError(RuntimeError):
    """Training or validation produced a NaN/inf loss; the run stops and keeps its last good checkpoint."""


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (disk full, read-only file system, no permission)."""
