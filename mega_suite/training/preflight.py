"""What a run checks before it creates or writes anything (docs/configuration.md#fault-handling).

- The run directory it will own: a fresh ``<run_root>/<recipe>/<time>``, an empty or new ``run_dir=``, or the
  run a ``resume=`` continues. A directory that holds a run is written only when ``resume=`` asks to continue
  it, and never when it is a run of another recipe (``resolve_run``).
- Every checkpoint it reads (``ckpt=``, ``init_from=``, ``resume=``): a file (or sharded folder) that exists,
  can be read, is complete, is of the right kind (a trainer checkpoint to resume; any with model weights to
  evaluate or fine-tune), and holds the model this run builds (``read_checkpoint``, ``check_model``).
- ``resume=auto`` / a run directory: the newest usable checkpoint of the run (``last.ckpt``, its previous
  generation ``last.ckpt.prev``, ``best-*.ckpt``), naming any it skips and why.
- That it can write where it would (``run_root``) and has the accelerator it asks for.

Every refusal is a ``ConfigError`` (one line, exit code 2 from ``run.py``) raised before the run directory
exists. ``claim_run_dir`` then creates it: atomically for a fresh one, so that two runs started in the same
second never share one.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from mega_suite.config import ConfigError
from mega_suite.models.bundle import BundleError, bundle_state, is_bundle
from mega_suite.training.checkpoint import PREVIOUS, is_sharded_checkpoint, remove_path, strip_prefixes
from mega_suite.training.saving import why


class MissingCheckpointError(ConfigError, FileNotFoundError):
    """A checkpoint named by ``ckpt=``, ``init_from=`` or ``resume=`` that does not exist."""


RUN_FILES = ("config.yaml", "checkpoints", "hparams.yaml")  # a directory with one of these holds a run


# --------------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------------


@dataclass
class CheckpointInfo:
    """What ``read_checkpoint`` found in a checkpoint, without loading its tensors into memory."""

    path: Path
    kind: str  # "trainer" (a Lightning checkpoint: resumable) | "weights" (model weights alone)
    global_step: int | None = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # model tensors (reference names)
    model: dict | None = None  # the model's config, as saved since issue 32
    run_config: dict | None = None  # the run's configuration, as saved since issue 32
    optimizer_groups: int | None = None  # parameter groups of its first optimizer


def read_checkpoint(path: str | Path, key: str) -> CheckpointInfo:
    """Open ``path`` (a ``torch.save`` file or a sharded checkpoint folder) and check it is complete; the
    ConfigError names ``key=path`` and what is wrong with it."""
    path = Path(path)
    where = f"{key}={path}"
    if not path.exists():
        raise MissingCheckpointError(f"{where}: no such checkpoint file or sharded checkpoint folder")
    if is_bundle(path):  # a safetensors bundle (python -m mega_suite.training.checkpoint export)
        try:
            state = bundle_state(path)
        except (BundleError, OSError) as exc:
            raise ConfigError(f"{where} is not a usable bundle: {_first_line(exc)}") from None
        info = CheckpointInfo(path, "weights")
        info.shapes = {strip_prefixes(k): tuple(v.shape) for k, v in state.items()}
        return info
    if path.is_dir():
        if not is_sharded_checkpoint(path):
            hint = (
                f"; it is a run directory: pass {path / 'checkpoints' / 'last.ckpt'}"
                if (path / "checkpoints").is_dir()
                else ""
            )
            raise ConfigError(f"{where} is a folder but not a sharded checkpoint (no .metadata in it){hint}")
        return _read_sharded(path, where)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {why(exc)}") from None
    if not magic:
        raise ConfigError(f"{where} is not a checkpoint: the file is empty (0 bytes)")
    if magic != b"PK\x03\x04":
        raise ConfigError(
            f"{where} is not a checkpoint: not a torch file (neither torch.save's zip format nor a sharded "
            "checkpoint folder)"
        )
    try:
        zipfile.ZipFile(path).close()  # the central directory at the end: missing when the file is cut short
    except (zipfile.BadZipFile, OSError):
        raise ConfigError(
            f"{where} is not a checkpoint: truncated (its zip archive has no end: a save or a copy cut short)"
        ) from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise ConfigError(f"{where} is not a checkpoint: damaged ({_first_line(exc)})") from None
    except pickle.UnpicklingError as exc:
        raise ConfigError(
            f"{where} holds Python objects other than tensors and plain values, which a safe load refuses "
            f"({_first_line(exc)})"
        ) from None
    return _describe(obj, path, where)


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split("\n")[0].split())[:160]


def _describe(obj: Any, path: Path, where: str) -> CheckpointInfo:
    if not isinstance(obj, dict):
        raise ConfigError(
            f"{where} is not a checkpoint: it holds a {type(obj).__name__}, not a dict of tensors"
        )
    extra = obj.get("mega_suite") if isinstance(obj.get("mega_suite"), dict) else {}
    if isinstance(obj.get("state_dict"), dict):
        tensors = {k: v for k, v in obj["state_dict"].items() if k.startswith("model.")}
        groups = None
        if isinstance(obj.get("optimizer_states"), list) and obj["optimizer_states"]:
            groups = len(obj["optimizer_states"][0].get("param_groups", []))
        kind = "trainer" if "loops" in obj and "global_step" in obj else "weights"
        info = CheckpointInfo(path, kind, obj.get("global_step"), optimizer_groups=groups)
    else:
        tensors = obj["model"] if isinstance(obj.get("model"), dict) else obj
        info = CheckpointInfo(path, "weights")
    shapes = {strip_prefixes(k): tuple(v.shape) for k, v in tensors.items() if torch.is_tensor(v)}
    if not shapes:
        raise ConfigError(f"{where} is not a checkpoint of a model: it holds no model tensors")
    info.shapes, info.model, info.run_config = shapes, extra.get("model"), extra.get("run_config")
    return info


def _read_sharded(path: Path, where: str) -> CheckpointInfo:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001  (any unreadable .metadata: pickle, EOF, OS errors)
        raise ConfigError(
            f"{where} is not a checkpoint: its .metadata cannot be read ({_first_line(exc)})"
        ) from None
    for item in (metadata.storage_data or {}).values():
        shard = path / item.relative_path
        size = shard.stat().st_size if shard.is_file() else -1
        if size < item.offset + item.length:
            state = "missing" if size < 0 else f"{size} bytes, {item.offset + item.length} expected"
            raise ConfigError(
                f"{where} is not a checkpoint: truncated or incomplete (shard {shard.name}: {state})"
            )
    shapes = {
        strip_prefixes(k): tuple(m.size)
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith("state_dict.model.") and hasattr(m, "size")
    }
    meta = path / "meta.pt"
    rest: dict = {}
    if meta.is_file():
        try:
            rest = torch.load(meta, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(
                f"{where} is not a checkpoint: its meta.pt is damaged ({_first_line(exc)})"
            ) from None
    groups = None  # a sharded optimizer's groups are not listed in its metadata
    kind = "trainer" if "loops" in rest and "global_step" in rest else "weights"
    extra = rest.get("mega_suite") if isinstance(rest.get("mega_suite"), dict) else {}
    if not shapes:
        raise ConfigError(f"{where} is not a checkpoint of a model: it holds no model tensors")
    return CheckpointInfo(
        path, kind, rest.get("global_step"), shapes, extra.get("model"), extra.get("run_config"), groups
    )


# model.* keys whose value follows the data (the data module's vocabulary, the data's class count)
_FROM_DATA = ("vocab_size", "num_classes")


def check_config_match(info: CheckpointInfo, cfg: DictConfig, key: str) -> None:
    """Before any data is prepared: a checkpoint that records its run's model section must have been trained
    with this run's (the keys the data sets aside)."""
    saved = (info.run_config or {}).get("model")
    if not isinstance(saved, dict):
        return
    ours = OmegaConf.to_container(cfg.model, resolve=True)
    differ = [k for k in _ordered(ours) if k not in _FROM_DATA and k in saved and saved[k] != ours[k]]
    if differ:
        raise ConfigError(_trained_with(info, key, differ, saved, ours, cfg))


_FIRST = ("arch", "preset", "num_classes", "num_layers", "model_dim", "num_heads", "z_dim", "value_dim")


def _ordered(values: dict) -> list[str]:
    """The model keys, those that name the model and its size first."""
    return [k for k in _FIRST if k in values] + [k for k in values if k not in _FIRST]


def _trained_with(info, key, differ, saved, ours, cfg) -> str:
    shown = differ[:6]
    more = f" and {len(differ) - len(shown)} more" if len(differ) > len(shown) else ""
    run = info.run_config or {}
    theirs = ", ".join(f"model.{k}={saved[k]}" for k in shown) + more
    mine = ", ".join(f"model.{k}={ours[k]}" for k in shown) + more
    where = ", ".join(f"{k}={run[k]}" for k in ("recipe", "task") if run.get(k) is not None)
    return (
        f"{key}={info.path}: checkpoint was trained with {theirs}"
        + (f" ({where})" if where else "")
        + f"; this run builds {mine} (recipe={cfg.recipe}, task={cfg.task}): use the recipe and model.* it was "
        "trained with"
    )


def check_model(
    info: CheckpointInfo, model: torch.nn.Module, model_cfg: Any, cfg: DictConfig, key: str
) -> None:
    """The checkpoint holds the model this run builds: every tensor name and shape (checked without loading
    the weights); the message names the config values or the tensors that differ."""
    ours = {strip_prefixes(k): tuple(v.shape) for k, v in model.state_dict().items()}
    ours = {k: v for k, v in ours.items() if k != "rope.freqs"}
    theirs = {k: v for k, v in info.shapes.items() if k != "rope.freqs"}
    if ours == theirs:
        return
    if info.model:
        mine = {"arch": type(model_cfg).__name__, **dataclasses.asdict(model_cfg)}
        differ = [k for k in _ordered(mine) if k in info.model and info.model[k] != mine[k]]
        if differ:
            raise ConfigError(_trained_with(info, key, differ, info.model, mine, cfg))
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    shapes = [
        f"{k} {theirs[k]} in the checkpoint, {ours[k]} here"
        for k in sorted(set(ours) & set(theirs))
        if ours[k] != theirs[k]
    ]
    parts = []
    if shapes:
        parts.append(
            "shapes differ: "
            + "; ".join(shapes[:4])
            + (f" (and {len(shapes) - 4} more)" if len(shapes) > 4 else "")
        )
    if missing:
        parts.append(f"{len(missing)} tensors of this model are not in it ({', '.join(missing[:3])}, ...)")
    if unexpected:
        parts.append(f"it has {len(unexpected)} tensors this model lacks ({', '.join(unexpected[:3])}, ...)")
    raise ConfigError(
        f"{key}={info.path} holds another model than this run builds (recipe={cfg.recipe}, "
        f"model.preset={cfg.model.preset}): {'; '.join(parts)}"
    )


def check_optimizer(info: CheckpointInfo, cfg: DictConfig) -> None:
    """Resuming restores the optimizer: its parameter groups must be the ones this run builds."""
    want = 2 if cfg.optim.no_decay_groups else 1
    if info.optimizer_groups is not None and info.optimizer_groups != want:
        raise ConfigError(
            f"resume={info.path}: its optimizer has {info.optimizer_groups} parameter group(s), this run builds "
            f"{want} (optim.no_decay_groups={str(bool(cfg.optim.no_decay_groups)).lower()}): resume with the "
            "value it was trained with, or start from its weights with init_from="
        )


# --------------------------------------------------------------------------------------------------------------
# Run directories
# --------------------------------------------------------------------------------------------------------------


def holds_run(run: Path) -> bool:
    return run.is_dir() and (
        any((run / name).exists() for name in RUN_FILES)
        or any(run.glob("config.resumed-*.yaml"))
        or any(run.glob("events.out.tfevents.*"))
    )


def run_recipe(run: Path) -> str | None:
    """The recipe of the run in ``run``, read from its configuration (None when unknown)."""
    for name in ["config.yaml", *sorted(p.name for p in run.glob("config.resumed-*.yaml"))[::-1]]:
        try:
            return str(OmegaConf.load(run / name).get("recipe"))
        except Exception:  # noqa: BLE001  (absent or unreadable: try the next)
            continue
    return None


def checkpoint_candidates(run: Path) -> list[Path]:
    """The checkpoints of a run a resume can continue from, in order of preference for equal steps."""
    folder = run / "checkpoints"
    names = ["last.ckpt", f"last.ckpt{PREVIOUS}", "last.ckpt.old"]
    found = [folder / n for n in names if (folder / n).exists()]
    found += sorted(folder.glob("best-*.ckpt"), reverse=True)
    return found


def newest_usable(run: Path, key: str) -> tuple[CheckpointInfo | None, list[str]]:
    """The usable checkpoint with the highest step (``last.ckpt`` on ties), and why others were skipped."""
    best, skipped = None, []
    for path in checkpoint_candidates(run):
        try:
            info = read_checkpoint(path, key)
        except ConfigError as exc:
            skipped.append(f"{path.name}: {str(exc).split(': ', 1)[-1]}")
            continue
        if info.kind != "trainer":
            skipped.append(f"{path.name}: model weights only (no trainer state to resume)")
            continue
        if best is None or (info.global_step or 0) > (best.global_step or 0):
            best = info
    return best, skipped


@dataclass
class RunTarget:
    """Where a run goes and what it continues from (resolved before anything is written)."""

    run_dir: Path
    resume: CheckpointInfo | None = None
    fresh: bool = True  # a new timestamped directory: created atomically with the next free suffix
    skipped: list[str] = field(default_factory=list)  # unusable checkpoints passed over by the resume


def resolve_run(cfg: DictConfig) -> RunTarget:
    """The run directory and the checkpoint to resume from (both checked); nothing is created or written."""
    root = Path(cfg.run_root)
    resume = cfg.resume
    if resume in (None, "", "none"):
        if cfg.run_dir:
            run = Path(cfg.run_dir)
            _refuse_existing(run, cfg)
            return RunTarget(run, fresh=False)
        return RunTarget(root / cfg.recipe / time.strftime("%Y%m%d-%H%M%S"))
    if resume == "auto":
        run = Path(cfg.run_dir) if cfg.run_dir else _latest_run(root, cfg.recipe)
        if run is None or not checkpoint_candidates(run):
            where = run if run is not None else root / cfg.recipe
            if run is not None and holds_run(run):
                _same_recipe(run, cfg, "resume=auto")
            print(f"[mega-suite] resume=auto: no checkpoint of {cfg.recipe!r} in {where}; starting fresh")
            cfg.resume = None
            return RunTarget(run, fresh=False) if run is not None else resolve_run(cfg)
        return _continue(run, cfg, "resume=auto")
    path = Path(resume)
    if path.is_dir() and not is_sharded_checkpoint(path):
        if not holds_run(path):
            raise ConfigError(f"resume={resume}: that folder holds no run (no config.yaml or checkpoints/)")
        return _continue(path, cfg, f"resume={resume}")
    info = read_checkpoint(path, "resume")
    if info.kind != "trainer":
        raise ConfigError(
            f"resume={path}: it holds model weights without the trainer state a resume continues (optimizer, "
            f"step); start from them with init_from={path}"
        )
    owner = path.parent.parent if path.parent.name == "checkpoints" else None
    if owner is not None and holds_run(owner):
        _same_recipe(owner, cfg, f"resume={resume}", info)
    check_config_match(info, cfg, "resume")
    check_optimizer(info, cfg)
    if owner is not None and holds_run(owner) and (not cfg.run_dir or Path(cfg.run_dir) == owner):
        return RunTarget(owner, info, fresh=False)
    # a checkpoint outside any run (or resumed into another run_dir): the continued run gets its own directory
    if cfg.run_dir:
        run = Path(cfg.run_dir)
        _refuse_existing(run, cfg, resuming=True)
        return RunTarget(run, info, fresh=False)
    return RunTarget(root / cfg.recipe / time.strftime("%Y%m%d-%H%M%S"), info)


def _continue(run: Path, cfg: DictConfig, key: str) -> RunTarget:
    _same_recipe(run, cfg, key)
    info, skipped = newest_usable(run, "resume")
    if info is None:
        raise ConfigError(
            f"{key}: no usable checkpoint in {run / 'checkpoints'} ({'; '.join(skipped) or 'none found'})"
        )
    if skipped and info.path.name != "last.ckpt":
        print(
            f"[mega-suite] {key}: skipped {'; '.join(skipped)}; resuming from {info.path.name} "
            f"(step {info.global_step}), the newest usable checkpoint"
        )
    check_config_match(info, cfg, "resume")
    check_optimizer(info, cfg)
    return RunTarget(run, info, fresh=False, skipped=[s.split(":")[0] for s in skipped])


def _latest_run(root: Path, recipe: str) -> Path | None:
    runs = sorted(
        p
        for p in (root / recipe).glob("*")
        if p.is_dir() and checkpoint_candidates(p) and run_recipe(p) in (None, recipe)
    )
    return runs[-1] if runs else None


def _same_recipe(run: Path, cfg: DictConfig, key: str, info: CheckpointInfo | None = None) -> None:
    other = run_recipe(run) or ((info.run_config or {}).get("recipe") if info else None)
    if other is not None and other != cfg.recipe:
        last = run / "checkpoints" / "last.ckpt"
        raise ConfigError(
            f"{key}: {run} is a run of recipe={other}, not recipe={cfg.recipe}; a resume writes into the run it "
            f"continues, so this is refused: continue it with recipe={other}, or start a {cfg.recipe} run from "
            f"its weights with init_from={last}"
        )


def _refuse_existing(run: Path, cfg: DictConfig, resuming: bool = False) -> None:
    """``run_dir=`` may name a new or empty folder; one that holds a run is only continued (``resume=``)."""
    if run.exists() and not run.is_dir():
        raise ConfigError(f"run_dir={run} is a file, not a folder")
    if not holds_run(run):
        return
    other = run_recipe(run)
    step = ""
    info, _ = newest_usable(run, "run_dir") if (run / "checkpoints").is_dir() else (None, [])
    if info is not None:
        step = f", checkpoint at step {info.global_step}"
    what = f"a run of recipe={other}{step}" if other else f"a run{step}"
    if other is not None and other != cfg.recipe:
        advice = f"continue it with recipe={other} resume=auto run_dir={run}"
    else:
        advice = f"continue it with resume=auto run_dir={run}"
    raise ConfigError(
        f"run_dir={run} already holds {what}; a {'resumed' if resuming else 'new'} run does not write into "
        f"another run: {advice}, or choose another run_dir (or leave it out: {cfg.run_root}/{cfg.recipe}/<time>)"
    )


def check_writable(target: RunTarget, cfg: DictConfig) -> None:
    """The run directory (or the nearest folder above it that exists) can be written."""
    path = target.run_dir
    while not path.exists() and path != path.parent:
        path = path.parent
    if not os.access(path, os.W_OK):
        key = "run_dir" if cfg.run_dir else "run_root"
        reason = "the file system is read-only" if _read_only(path) else "permission denied"
        raise ConfigError(
            f"{key}={cfg.run_dir or cfg.run_root}: cannot create the run directory {target.run_dir} ({path}: "
            f"{reason}); set {key}= to a writable folder"
        )


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def claim_run_dir(target: RunTarget, cfg: DictConfig) -> Path:
    """Create the run directory. A fresh one is created atomically (``mkdir`` without ``exist_ok``): a run
    started in the same second that took the name makes this one take the next free ``-N`` suffix."""
    run, n = target.run_dir, 1
    try:
        if not target.fresh:
            run.mkdir(parents=True, exist_ok=True)
        else:
            run.parent.mkdir(parents=True, exist_ok=True)
            while True:
                try:
                    run.mkdir()
                    break
                except FileExistsError:
                    run = target.run_dir.with_name(f"{target.run_dir.name}-{n}")
                    n += 1
    except OSError as exc:
        key = "run_dir" if cfg.run_dir else "run_root"
        raise ConfigError(
            f"{key}={cfg.run_dir or cfg.run_root}: cannot create the run directory {run}: {why(exc)}"
        ) from None
    return run


def tidy_for_resume(target: RunTarget) -> None:
    """Before a resumed run writes: remove partial saves (``*.tmp``) a killed run left, and move an unusable
    ``last.ckpt`` the resume skipped aside (``last.ckpt.unusable``), so that the next save does not make it
    the previous generation in place of the good one."""
    folder = target.run_dir / "checkpoints"
    if not folder.is_dir():
        return
    for tmp in sorted(folder.glob("*.tmp")):
        size = (
            sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            if tmp.is_dir()
            else tmp.stat().st_size
        )
        remove_path(tmp)
        print(
            f"[mega-suite] removed {tmp.name} ({size / 2**20:.1f} MiB), a save an earlier run did not finish"
        )
    if "last.ckpt" in target.skipped and (folder / "last.ckpt").exists():
        os.replace(folder / "last.ckpt", folder / "last.ckpt.unusable")
        print("[mega-suite] moved the unusable last.ckpt aside to last.ckpt.unusable")


# --------------------------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------------------------


def check_accelerator(cfg: DictConfig) -> None:
    """``trainer.accelerator=gpu|cuda`` needs CUDA devices, as many as ``trainer.devices`` asks; on the CPU
    ``trainer.devices`` counts processes."""
    t = cfg.trainer
    devices = t.devices
    if t.accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"trainer.accelerator={t.accelerator} but no CUDA device is visible here; use "
                "trainer.accelerator=cpu (or auto)"
            )
        have = torch.cuda.device_count()
        want = devices if isinstance(devices, int) else len(devices) if not isinstance(devices, str) else 1
        if want > have:
            raise ConfigError(f"trainer.devices={devices} but {have} CUDA device(s) are visible here")
    cpu = t.accelerator == "cpu" or (t.accelerator == "auto" and not torch.cuda.is_available())
    if cpu and not isinstance(devices, (int, str)):
        raise ConfigError(
            f"trainer.devices={list(devices)}: on the CPU trainer.devices is a number of processes, not a list "
            "of device indices"
        )
