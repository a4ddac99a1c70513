"""What a run folder looks like on disk (docs/configuration.md#what-a-command-writes): how one is recognised
and which of its checkpoints a resume or an evaluation may read."""

from __future__ import annotations

from pathlib import Path

RUN_FILES = ("config.yaml", "checkpoints", "hparams.yaml")  # a folder with one of these holds a training run
EVAL_CONFIG = "eval.yaml"  # an evaluation folder's resolved configuration (a training run's is config.yaml)
PREVIOUS = ".prev"  # the checkpoint a save replaced, kept until the next save: one generation back


def is_run_folder(path) -> bool:
    """A folder a training run wrote (its configuration, checkpoints or logs)."""
    path = Path(path)
    return (
        path.is_dir()
        and (
            any((path / name).exists() for name in RUN_FILES)
            or any(path.glob("config.resumed-*.yaml"))
            or any(path.glob("events.out.tfevents.*"))
        )
        and not (path / EVAL_CONFIG).is_file()
    )


def run_checkpoints(run: Path) -> list[Path]:
    """A run's checkpoints that a resume or an evaluation may read, in order of preference for equal steps."""
    folder = Path(run) / "checkpoints"
    names = ["last.ckpt", f"last.ckpt{PREVIOUS}", "last.ckpt.old"]
    found = [folder / n for n in names if (folder / n).exists()]
    return found + sorted(folder.glob("best-*.ckpt"), reverse=True)
