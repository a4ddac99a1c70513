"""The one reader of checkpoints (docs/configuration.md#checkpoints).

``open_checkpoint(value, key)`` takes whatever a user names with ``ckpt=``, ``init_from=``, ``resume=`` or a
tool's argument, recognises it and checks it, without loading its tensors:

- a file written by ``torch.save`` (a suite Lightning checkpoint, or a state dict in the reference format);
- a sharded folder of ``trainer.strategy=fsdp`` (torch.distributed.checkpoint: ``.metadata`` and shards);
- a bundle (``export``: ``config.json`` and safetensors files);
- a run folder: its newest usable checkpoint (``last.ckpt``, ``last.ckpt.prev``, ``best-*.ckpt``).

Anything else is a ``CheckpointError``: one line naming ``key=value`` and what is wrong (missing, empty,
truncated, damaged, another format, no model tensors). ``Checkpoint.state()`` then loads the model's weights
in reference names, and ``load_into`` loads them strictly into a model.

Nothing is unpickled freely. ``torch.load`` runs with ``weights_only=True``. A sharded folder's ``.metadata`` is
a plain pickle that torch.distributed.checkpoint reads with ``pickle.load``, and the non-tensor items of its
shards are read with ``torch.load(weights_only=False)``: both are checked here first, the metadata through an
allow-list of torch.distributed.checkpoint's own classes and every non-tensor item with
``weights_only=True``, so a folder that would run code is refused before any reader of torch's sees it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from datamodules.safe_pickle import restricted_load
from mega_suite.errors import CheckpointError, MissingCheckpointError
from mega_suite.models.bundle import INDEX, WEIGHTS, BundleError, bundle_state, is_bundle, read_config
from mega_suite.models.common import state_mismatch
from mega_suite.storage.layout import is_run_folder, run_checkpoints

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


def first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split("\n")[0].split())[:200]


@dataclass
class Checkpoint:
    """What ``open_checkpoint`` found, without the tensors loaded."""

    path: Path  # the file or folder read (a run folder's chosen checkpoint)
    format: str  # "file" (torch.save) | "sharded" | "bundle"
    kind: str  # "trainer" (a Lightning checkpoint: resumable) | "weights" (model weights alone)
    global_step: int | None = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # model tensors (reference names)
    model: dict | None = None  # the model's config as saved (suite checkpoints)
    run_config: dict | None = None  # the configuration of the run that saved it
    optimizer_groups: int | None = None  # parameter groups of its first optimizer (file checkpoints)
    tokenizer_digest: str | None = None  # sha256 of the tokenizer the run trained with
    skipped: list[str] = field(default_factory=list)  # a run folder's unusable checkpoints passed over, why

    @property
    def run_dir(self) -> Path | None:
        """The training run this checkpoint lies in (``<run>/checkpoints/<ckpt>``), if any."""
        parent = self.path.parent
        if parent.name == "checkpoints" and is_run_folder(parent.parent):
            return parent.parent
        return None

    @property
    def mtime(self) -> float:
        return self.path.stat().st_mtime

    def state(self) -> OrderedDict[str, Tensor]:
        """The model's weights in reference names (a whole model: sharded checkpoints are gathered here)."""
        if self.format == "bundle":
            return OrderedDict(bundle_state(self.path))
        if self.format == "sharded":
            return _sharded_model_state(self.path)
        obj = torch.load(self.path, map_location="cpu", weights_only=True)
        return OrderedDict((strip_prefixes(k), v) for k, v in _model_tensors(obj).items())


def _model_tensors(obj: Any) -> dict[str, Any]:
    """The model's entries of a loaded checkpoint file: a Lightning checkpoint's ``model.*`` state, a dict's
    ``model`` entry, or the dict itself (a state dict)."""
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        return {k: v for k, v in obj["state_dict"].items() if k.startswith("model.")}
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        return obj["model"]
    return obj


# --------------------------------------------------------------------------------------------------------------
# Recognising and checking
# --------------------------------------------------------------------------------------------------------------


def is_sharded_checkpoint(path) -> bool:
    """A folder written by torch.distributed.checkpoint (Lightning's ModelParallelStrategy): ``.metadata``,
    one ``__R_0.distcp`` shard per rank and the trainer state in ``meta.pt``."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


def open_checkpoint(value: str | os.PathLike, key: str, need: str = "weights") -> Checkpoint:
    """Recognise and check the checkpoint ``key=value`` names; ``need="trainer"``: one a resume can continue
    (optimizer and step included). A ``CheckpointError`` names ``key=value`` and what is wrong."""
    path = Path(os.path.expanduser(str(value)))
    where = f"{key}={value}"
    if not path.exists():
        raise MissingCheckpointError(
            f"{where}: no such checkpoint file, sharded checkpoint folder, bundle or run folder"
        )
    if path.is_dir():
        if is_bundle(path) or (path / "config.json").is_file() and not is_sharded_checkpoint(path):
            found = _inspect_bundle(path, where)
        elif is_sharded_checkpoint(path):
            found = _inspect_sharded(path, where)
        elif is_run_folder(path):
            return _inspect_run(path, where, need)
        elif path.name == "checkpoints" and is_run_folder(path.parent):
            return _inspect_run(path.parent, where, need)
        else:
            raise CheckpointError(
                f"{where} is a folder but not a checkpoint: neither a sharded checkpoint (.metadata), a bundle "
                "(config.json and model.safetensors) nor a run folder (config.yaml, checkpoints/)"
            )
    else:
        found = _inspect_file(path, where)
    if need == "trainer" and found.kind != "trainer":
        raise CheckpointError(
            f"{where}: it holds model weights without the trainer state a resume continues (optimizer, step); "
            f"start from them with init_from={value}"
        )
    return found


def newest_usable(run: Path, key: str, need: str = "trainer") -> tuple[Checkpoint | None, list[str]]:
    """The usable checkpoint of a run with the highest step (``last.ckpt`` on ties), and why others were
    skipped."""
    best, skipped = None, []
    for path in run_checkpoints(run):
        try:
            found = open_checkpoint(path, key, need=need)
        except CheckpointError as exc:
            skipped.append(f"{path.name}: {str(exc).split(': ', 1)[-1]}")
            continue
        if best is None or (found.global_step or 0) > (best.global_step or 0):
            best = found
    return best, skipped


def _inspect_run(run: Path, where: str, need: str) -> Checkpoint:
    found, skipped = newest_usable(run, where.split("=", 1)[0], need)
    if found is None:
        raise CheckpointError(
            f"{where}: no usable checkpoint in {run / 'checkpoints'} ({'; '.join(skipped) or 'none found'})"
        )
    found.skipped = skipped
    return found


def _inspect_file(path: Path, where: str) -> Checkpoint:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise CheckpointError(f"{where} cannot be read: {exc.strerror or exc}") from None
    if not magic:
        raise CheckpointError(f"{where} is not a checkpoint: the file is empty (0 bytes)")
    if magic != b"PK\x03\x04":
        raise CheckpointError(
            f"{where} is not a checkpoint: not a torch file (neither torch.save's zip format, a sharded "
            "checkpoint folder, a bundle nor a run folder)"
        )
    try:
        zipfile.ZipFile(path).close()  # the central directory at the end: missing when the file is cut short
    except (zipfile.BadZipFile, OSError):
        raise CheckpointError(
            f"{where} is not a checkpoint: truncated (its zip archive has no end: a save or a copy cut short)"
        ) from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{where} holds Python objects other than tensors and plain values, which a safe load refuses "
            f"({first_line(exc)})"
        ) from None
    except Exception as exc:  # noqa: BLE001  (torch raises RuntimeError, EOFError, ValueError, ... on damage)
        raise CheckpointError(f"{where} is not a checkpoint: damaged ({first_line(exc)})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where} is not a checkpoint: it holds a {type(obj).__name__}, not a dict")
    extra = obj.get("mega_suite") if isinstance(obj.get("mega_suite"), dict) else {}
    groups = None
    if isinstance(obj.get("optimizer_states"), list) and obj["optimizer_states"]:
        first = obj["optimizer_states"][0]
        groups = len(first.get("param_groups", [])) if isinstance(first, dict) else None
    kind = (
        "trainer"
        if isinstance(obj.get("state_dict"), dict) and "loops" in obj and "global_step" in obj
        else "weights"
    )
    shapes = {strip_prefixes(k): tuple(v.shape) for k, v in _model_tensors(obj).items() if torch.is_tensor(v)}
    if not shapes:
        raise CheckpointError(f"{where} is not a checkpoint of a model: it holds no model tensors")
    step = obj.get("global_step") if isinstance(obj.get("global_step"), int) else None
    return Checkpoint(
        path, "file", kind, step, shapes, extra.get("model"), extra.get("run_config"), groups,
        extra.get("tokenizer_digest"),
    )  # fmt: skip


def _inspect_bundle(path: Path, where: str) -> Checkpoint:
    from safetensors import SafetensorError, safe_open

    try:
        read_config(path)  # config.json: a valid model configuration of a registered architecture
        raw = json.loads((path / "config.json").read_text())
        if (path / INDEX).is_file():
            files = sorted({path / f for f in json.loads((path / INDEX).read_text())["weight_map"].values()})
        else:
            files = [path / WEIGHTS]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise BundleError(f"its weight files {missing} are missing")
        shapes = {}
        for file in files:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    shapes[strip_prefixes(name)] = tuple(f.get_slice(name).get_shape())
    except (BundleError, SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{where} is not a usable bundle: {first_line(exc)}") from None
    for alias, source in (raw.get("tied_weights") or {}).items():
        if strip_prefixes(source) in shapes:
            shapes[strip_prefixes(alias)] = shapes[strip_prefixes(source)]
    if not shapes:
        raise CheckpointError(f"{where} is not a usable bundle: its weight files hold no tensors")
    step = raw.get("step") if isinstance(raw.get("step"), int) else None
    model = {"arch": raw.get("arch"), **(raw.get("suite_config") or {})}
    return Checkpoint(
        path, "bundle", "weights", step, shapes, model, tokenizer_digest=raw.get("tokenizer_digest")
    )


# --------------------------------------------------------------------------------------------------------------
# Sharded checkpoints, read without running anything they hold
# --------------------------------------------------------------------------------------------------------------

# What a torch.distributed.checkpoint .metadata pickle may name: its own dataclasses, torch.Size, dtypes,
# layouts (torch.serialization._get_layout maps a name to a torch.layout) and the checkpoint id's path.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_DCP_CLASSES = {
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata",
    "BytesStorageMetadata", "_MEM_FORMAT_ENCODING", "_StorageInfo",
}  # fmt: skip


def _dcp_global(module: str, name: str) -> bool:
    if module in _DCP_MODULES:
        return name in _DCP_CLASSES
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    if module == "torch.serialization":
        return name == "_get_layout"
    return module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "Path")


def read_metadata(path: Path):
    """A sharded checkpoint's ``.metadata``, unpickled through the allow-list."""
    with open(path / ".metadata", "rb") as f:
        return restricted_load(f, _dcp_global)


def _inspect_sharded(path: Path, where: str) -> Checkpoint:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    try:
        metadata = read_metadata(path)
    except Exception as exc:  # noqa: BLE001  (refused globals, pickle, EOF and OS errors)
        raise CheckpointError(
            f"{where} is not a checkpoint: its .metadata cannot be read safely ({first_line(exc)})"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(
            f"{where} is not a checkpoint: its .metadata is not torch.distributed.checkpoint's"
        )
    for index, item in metadata.storage_data.items():
        shard = path / item.relative_path
        if shard.resolve().parent != path.resolve():
            raise CheckpointError(
                f"{where} is not a checkpoint: a shard lies outside its folder ({item.relative_path})"
            )
        size = shard.stat().st_size if shard.is_file() else -1
        if size < item.offset + item.length:
            state = "missing" if size < 0 else f"{size} bytes, {item.offset + item.length} expected"
            raise CheckpointError(
                f"{where} is not a checkpoint: truncated or incomplete (shard {shard.name}: {state})"
            )
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            _check_bytes_item(shard, item, f"{where} ({index.fqn})")
    rest = {}
    if (path / "meta.pt").is_file():
        try:
            rest = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(
                f"{where} is not a checkpoint: its meta.pt is damaged or unsafe ({first_line(exc)})"
            ) from None
    shapes = {
        strip_prefixes(k): tuple(m.size)
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith("state_dict.model.") and hasattr(m, "size")
    }
    if not shapes:
        raise CheckpointError(f"{where} is not a checkpoint of a model: it holds no model tensors")
    rest = rest if isinstance(rest, dict) else {}
    extra = rest.get("mega_suite") if isinstance(rest.get("mega_suite"), dict) else {}
    kind = "trainer" if "loops" in rest and "global_step" in rest else "weights"
    step = rest.get("global_step") if isinstance(rest.get("global_step"), int) else None
    return Checkpoint(
        path, "sharded", kind, step, shapes, extra.get("model"), extra.get("run_config"), None,
        extra.get("tokenizer_digest"),
    )  # fmt: skip


def _check_bytes_item(shard: Path, item, where: str) -> None:
    """A non-tensor item of a shard (torch.distributed.checkpoint loads these with ``weights_only=False``)
    must load with ``weights_only=True``."""
    if item.transform_descriptors:
        raise CheckpointError(f"{where}: a transformed (compressed) item, which this reader does not check")
    with open(shard, "rb") as f:
        f.seek(item.offset)
        data = f.read(item.length)
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(
            f"{where} is not a checkpoint a safe load accepts: a stored item holds Python objects other than "
            f"tensors and plain values ({first_line(exc)})"
        ) from None


def _sharded_model_state(path: Path) -> OrderedDict[str, Tensor]:
    """The model tensors of a checked sharded checkpoint, gathered on one process (no process group)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class Reader(FileSystemReader):  # the checked metadata, never pickle.load
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(Path(self.path))
            metadata.storage_meta = metadata.storage_meta or _storage_meta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    _inspect_sharded(path, str(path))  # refuses a folder that would run code before torch reads it
    keys = {k for k in read_metadata(path).state_dict_metadata if k.startswith("state_dict.model.")}
    state: dict = {}
    # dcp_to_torch_save's loader (private in torch), restricted to the model's tensors
    _load_state_dict(
        state, storage_reader=Reader(str(path)), planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True
    )
    flat = _flatten(state, "")  # {"state_dict": {"model.x": t}} -> "state_dict.model.x"
    return OrderedDict((strip_prefixes(k), v) for k, v in flat.items() if torch.is_tensor(v))


def _storage_meta():
    from torch.distributed.checkpoint.metadata import StorageMeta

    return StorageMeta()


def _flatten(tree: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out


# --------------------------------------------------------------------------------------------------------------
# Loading into a model
# --------------------------------------------------------------------------------------------------------------

# The release keeps RoPE's inverse frequencies as a buffer; ours are computed from model.rope_base.
_DERIVED = ("rope.freqs",)


def _check_rope(freqs: Tensor, model: nn.Module | None) -> None:
    cfg = getattr(model, "cfg", None)
    if cfg is None or freqs.dim() != 1 or not hasattr(cfg, "z_dim"):
        return
    d = cfg.z_dim // cfg.num_heads
    ours = cfg.rope_base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    if freqs.numel() == ours.numel() and not torch.allclose(freqs.double(), ours, rtol=1e-4):
        raise ValueError(
            f"checkpoint rope.freqs do not match model.rope_base={cfg.rope_base}; set rope_base to the "
            "checkpoint's base (the paper's 7B used 100000)"
        )


def to_reference(model: nn.Module) -> OrderedDict[str, Tensor]:
    """Our model -> a reference-format state dict (detached tensors, names unchanged)."""
    return OrderedDict((strip_prefixes(k), v.detach()) for k, v in model.state_dict().items())


def from_reference(state_dict: dict[str, Tensor], model: nn.Module | None = None) -> OrderedDict[str, Tensor]:
    """A reference-format state dict -> ours (names are the release's: a checked identity). With ``model``,
    every key and shape is checked against it; buffers the release stores but we derive from the config
    (``rope.freqs``) are checked and dropped."""
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


def load_into(model: nn.Module, source: Checkpoint | str | os.PathLike, key: str = "ckpt") -> nn.Module:
    """The model weights of a checkpoint (any format ``open_checkpoint`` reads) loaded strictly."""
    checkpoint = source if isinstance(source, Checkpoint) else open_checkpoint(source, key)
    return load_reference(model, checkpoint.state())


def load_full_weights(model: nn.Module, source: Checkpoint | str | os.PathLike) -> None:
    """Load a checkpoint's model weights into a sharded model: rank 0 reads and checks the file, and
    ``set_model_state_dict`` broadcasts each tensor and keeps every rank's shard (``broadcast_from_rank0``), so
    the other ranks never hold the whole model."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not (dist.is_available() and dist.is_initialized()):
        load_into(model, source)
        return
    state = {}
    if dist.get_rank() == 0:
        checkpoint = source if isinstance(source, Checkpoint) else open_checkpoint(source, "ckpt")
        state = dict(from_reference(checkpoint.state(), model))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)
