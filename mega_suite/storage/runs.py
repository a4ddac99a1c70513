"""The one writer of run folders (docs/configuration.md#what-a-command-writes).

Where a command writes is decided with its plan, before anything exists (``training_output``,
``evaluation_output``), and the folder is created only once the whole plan is valid (``claim``):

- training (``mode=fit``): a fresh ``<run_root>/<recipe>/<time>``, a new or empty ``run_dir=``, or the run a
  ``resume=`` continues. A folder that holds another run, a user's files, or lies inside a run is refused;
- evaluation (every other mode but ``plan``): ``<run>/eval/<mode>-<time>`` beside the run whose checkpoint it
  evaluates, ``<run_root>/<recipe>/eval/<mode>-<time>`` for a bundle or a loose checkpoint, or a new or empty
  ``run_dir=``. An evaluation's folder holds ``eval.yaml``, never ``config.yaml`` or ``checkpoints/``: it is
  never taken for a training run, and nothing of the run it evaluates is written;
- ``resume=auto`` continues the run of the recipe whose newest checkpoint is newest (by the checkpoints'
  time, not the folders' names).

A claimed folder is locked (``fcntl.flock`` on ``.lock``) for the life of the process: a second command that
would write into it (two ``resume=auto`` of one run) is refused, naming the process that holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from mega_suite.errors import RunFolderError
from mega_suite.storage.checkpoints import Checkpoint, newest_usable, open_checkpoint
from mega_suite.storage.layout import EVAL_CONFIG, is_run_folder, run_checkpoints

LOCK = ".lock"
__all__ = ["EVAL_CONFIG", "LOCK", "Output", "claim", "evaluation_output", "training_output"]


@dataclass(frozen=True)
class Output:
    """Where a command writes, decided before anything exists."""

    path: Path
    kind: str  # "train" | "eval"
    fresh: bool = True  # a new timestamped folder: created with the next free -N suffix if the name is taken
    resuming: bool = False  # continues the training run in ``path``
    notes: tuple[str, ...] = field(default_factory=tuple)  # what the resolution decided, for the log


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def run_config(run: Path) -> dict:
    """The configuration a run folder records (its newest resumed one, else ``config.yaml``; {} when none is
    readable)."""
    import yaml

    for name in [*sorted(p.name for p in run.glob("config.resumed-*.yaml"))[::-1], "config.yaml"]:
        try:
            found = yaml.safe_load((run / name).read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(found, dict):
            return found
    return {}


def run_recipe(run: Path) -> str | None:
    """The recipe of the run in ``run`` (None when unknown)."""
    recipe = run_config(run).get("recipe")
    return None if recipe is None else str(recipe)


def _is_run_of(run: Path, recipe: str, arch: str | None) -> bool:
    """``run`` records ``recipe`` and, when given, ``arch`` (or does not say)."""
    cfg = run_config(run)
    ran, trained = cfg.get("recipe"), (cfg.get("model") or {}).get("arch")
    return (ran is None or str(ran) == recipe) and (arch is None or trained is None or str(trained) == arch)


def enclosing_run(path: Path) -> Path | None:
    """The training run folder ``path`` lies inside (``path`` itself excluded), if any."""
    for parent in Path(path).resolve().parents:
        if is_run_folder(parent):
            return parent
    return None


def check_new_or_empty(path: Path, key: str, recipe: str, kind: str) -> None:
    """``run_dir=`` for a new run or evaluation: a folder that does not exist yet, or an empty one."""
    if path.exists() and not path.is_dir():
        raise RunFolderError(f"{key}={path} is a file, not a folder")
    inside = enclosing_run(path)
    if inside is not None:
        raise RunFolderError(
            f"{key}={path} lies inside the run {inside}; a command writes a folder of its own: choose a folder "
            "outside any run (or leave run_dir out)"
        )
    if not path.is_dir() or not any(path.iterdir()):
        return
    if is_run_folder(path):
        other = run_recipe(path)
        found, _ = newest_usable(path, key) if (path / "checkpoints").is_dir() else (None, [])
        step = f", checkpoint at step {found.global_step}" if found is not None else ""
        what = f"a run of recipe={other}{step}" if other else f"a run{step}"
        again = f"recipe={other} " if other is not None and other != recipe else ""
        advice = f"continue it with {again}resume=auto run_dir={path}, or " if kind == "train" else ""
        raise RunFolderError(
            f"{key}={path} already holds {what}; a new {'run' if kind == 'train' else 'evaluation'} does not "
            f"write into another run: {advice}choose another run_dir (or leave it out)"
        )
    raise RunFolderError(
        f"{key}={path} is a folder that is not empty and holds no run; a {'run' if kind == 'train' else 'command'} "
        "writes into a new or empty folder only, so that none of your files is overwritten: choose another "
        "run_dir (or leave it out)"
    )


def same_recipe(run: Path, recipe: str, key: str, checkpoint: Checkpoint | None = None) -> None:
    other = run_recipe(run) or ((checkpoint.run_config or {}).get("recipe") if checkpoint else None)
    if other is not None and other != recipe:
        raise RunFolderError(
            f"{key}: {run} is a run of recipe={other}, not recipe={recipe}; a resume writes into the run it "
            f"continues, so this is refused: continue it with recipe={other}, or start a {recipe} run from its "
            f"weights with init_from={run}"
        )


def _newest_checkpoint_time(run: Path) -> float:
    times = [p.stat().st_mtime for p in run_checkpoints(run)]
    return max(times) if times else -1.0


def newest_run(folder: Path, recipe: str, arch: str | None = None) -> Path | None:
    """The run of ``recipe`` (and of the architecture ``arch``, when given: a Llama comparison run of the same
    recipe is not the Megalodon run to continue) in ``folder`` whose newest checkpoint was written last."""
    if not folder.is_dir():
        return None
    runs = [
        p for p in folder.iterdir() if is_run_folder(p) and run_checkpoints(p) and _is_run_of(p, recipe, arch)
    ]
    return max(runs, key=_newest_checkpoint_time, default=None)


def training_output(
    run_root: Path, recipe: str, run_dir: str | None, resume: str | None, arch: str | None = None
) -> tuple[Output, Checkpoint | None]:
    """Where ``mode=fit`` writes and the checkpoint it continues from (checked); nothing is created."""
    root = Path(run_root)
    if not resume:
        if run_dir:
            check_new_or_empty(Path(run_dir), "run_dir", recipe, "train")
            return Output(Path(run_dir), "train", fresh=False), None
        return Output(root / recipe / _stamp(), "train"), None
    if resume == "auto":
        run = Path(run_dir) if run_dir else newest_run(root / recipe, recipe, arch)
        where = run if run is not None else root / recipe
        if run is None or not is_run_folder(run):
            if run is not None:
                check_new_or_empty(run, "run_dir", recipe, "train")
            note = f"resume=auto: no run of {recipe!r} in {where}; starting fresh"
            return Output(run or root / recipe / _stamp(), "train", fresh=run is None, notes=(note,)), None
        if not run_checkpoints(run):
            same_recipe(run, recipe, "resume=auto")
            note = f"resume=auto: the run {run} has no checkpoint yet; starting it afresh"
            return Output(run, "train", fresh=False, notes=(note,)), None
        return _continue(run, recipe, "resume=auto")
    path = Path(resume)
    if path.is_dir() and is_run_folder(path):
        if run_dir and Path(run_dir).resolve() != path.resolve():
            raise RunFolderError(
                f"resume={resume} continues that run in its own folder; run_dir={run_dir} names another: "
                "leave run_dir out, or start a new run from its weights with init_from="
            )
        return _continue(path, recipe, f"resume={resume}")
    found = open_checkpoint(path, "resume", need="trainer")
    owner = found.run_dir
    if owner is not None:
        same_recipe(owner, recipe, f"resume={resume}", found)
    elif (found.run_config or {}).get("recipe") not in (None, recipe):
        same_recipe(path.parent, recipe, f"resume={resume}", found)
    if owner is not None and (not run_dir or Path(run_dir).resolve() == owner.resolve()):
        return Output(owner, "train", fresh=False, resuming=True), found
    # a checkpoint outside any run (or resumed into another run_dir): the continued run gets its own folder
    if run_dir:
        check_new_or_empty(Path(run_dir), "run_dir", recipe, "train")
        return Output(Path(run_dir), "train", fresh=False, resuming=True), found
    return Output(root / recipe / _stamp(), "train", resuming=True), found


def _continue(run: Path, recipe: str, key: str) -> tuple[Output, Checkpoint]:
    same_recipe(run, recipe, key)
    found = open_checkpoint(run, key, need="trainer")
    notes = ()
    if found.skipped and found.path.name != "last.ckpt":
        notes = (
            f"{key}: skipped {'; '.join(found.skipped)}; resuming from {found.path.name} (step "
            f"{found.global_step}), the newest usable checkpoint",
        )
    return Output(run, "train", fresh=False, resuming=True, notes=notes), found


def evaluation_output(
    run_root: Path, recipe: str, mode: str, run_dir: str | None, evaluated: list[Checkpoint]
) -> Output:
    """Where an evaluation writes: ``run_dir=`` (new or empty), else beside the run it evaluates."""
    if run_dir:
        check_new_or_empty(Path(run_dir), "run_dir", recipe, "eval")
        return Output(Path(run_dir), "eval", fresh=False)
    owners = {c.run_dir for c in evaluated}
    base = owners.pop() if len(owners) == 1 and None not in owners else Path(run_root) / recipe
    return Output(base / "eval" / f"{mode}-{_stamp()}", "eval")


# --------------------------------------------------------------------------------------------------------------
# Claiming
# --------------------------------------------------------------------------------------------------------------


class Claimed:
    """A run or evaluation folder this process writes, locked until ``release`` (or the process's end)."""

    def __init__(self, path: Path, lock):
        self.path, self._lock = path, lock

    def release(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def __enter__(self) -> Claimed:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_folder(path: Path):
    """An exclusive lock on ``path/.lock`` for the life of the returned file; refused when another process
    holds it."""
    handle = open(path / LOCK, "a+")  # noqa: SIM115  (held open: the lock lives as long as the file)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunFolderError(
            f"{path} is in use by another process ({holder}): two commands would write into one run; wait for "
            "it to end (or stop it) and try again"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    return handle


def claim(output: Output) -> Claimed:
    """Create (or open) the folder of ``output`` and lock it. A fresh one is created atomically (``mkdir``
    without ``exist_ok``): a command started in the same second that took the name makes this one take the
    next free ``-N`` suffix."""
    path, n = output.path, 1
    try:
        if not output.fresh:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            while True:
                try:
                    path.mkdir()
                    break
                except FileExistsError:
                    path = output.path.with_name(f"{output.path.name}-{n}")
                    n += 1
    except OSError as exc:
        raise RunFolderError(f"cannot create the folder {path}: {exc.strerror or exc}") from None
    return Claimed(path, lock_folder(path))


def tidy_for_resume(folder: Path, skipped: list[str]) -> None:
    """Before a resumed run writes: remove partial saves (``*.tmp``) a killed run left, and move an unusable
    ``last.ckpt`` the resume skipped aside (``last.ckpt.unusable``), so that the next save does not make it the
    previous generation in place of the good one."""
    from mega_suite.storage.atomic import remove_path

    checkpoints = Path(folder) / "checkpoints"
    if not checkpoints.is_dir():
        return
    for tmp in sorted(checkpoints.glob("*.tmp")):
        size = (
            sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            if tmp.is_dir()
            else tmp.stat().st_size
        )
        remove_path(tmp)
        print(
            f"[mega-suite] removed {tmp.name} ({size / 2**20:.1f} MiB), a save an earlier run did not finish"
        )
    if any(s.split(":")[0] == "last.ckpt" for s in skipped) and (checkpoints / "last.ckpt").exists():
        os.replace(checkpoints / "last.ckpt", checkpoints / "last.ckpt.unusable")
        print("[mega-suite] moved the unusable last.ckpt aside to last.ckpt.unusable")
