"""Shareable weights: a folder with ``model.safetensors`` (sharded with an index when large), ``config.json``
and the tokenizer, readable by ``from_pretrained`` here and by ``transformers`` alone (``AutoModelForCausalLM``
with ``trust_remote_code``: the standalone model's two files, ``models/hf/``, are copied beside the weights;
``AutoTokenizer``: a fast ``tokenizer.json`` converted from the run's tokenizer, ``models/hf/tokenizer.py``).

Tensor names are the model's own with the wrapper's ``model.`` prefix. A tied output projection is stored
once, under the embedding's name (safetensors refuses two names for one tensor), and ``config.json`` lists the
alias in ``tied_weights``. docs/after_training.md#shareable-weights describes the format.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mega_suite.models.common import state_mismatch
from mega_suite.models.registry import ARCHS, arch_of, build_model

FORMAT = 1  # config.json's mega_suite_format
PREFIX = "model."  # the transformers wrapper holds the suite model as .model
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
HF_FILES = ("configuration_mega_suite.py", "modeling_mega_suite.py")
AUTO_MAP = {
    "AutoConfig": "configuration_mega_suite.MegaSuiteConfig",
    "AutoModelForCausalLM": "modeling_mega_suite.MegaSuiteForCausalLM",
}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}  # fmt: skip


class BundleError(ValueError):
    """A bundle folder that cannot be read or written; the message names the file and what was expected."""


def is_bundle(path) -> bool:
    path = Path(path)
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and ((path / WEIGHTS).is_file() or (path / INDEX).is_file())
    )


def _tied_names(model: nn.Module, state: dict[str, Tensor]) -> dict[str, str]:
    """alias -> the first name of the same tensor (same storage, offset, shape and strides)."""
    first: dict[tuple, str] = {}
    tied = {}
    for name, t in state.items():
        if t.numel() == 0:
            continue
        key = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
        )
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


def save_bundle(
    model: nn.Module,
    out_dir: str | os.PathLike,
    tokenizer: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (a registered language model) as a bundle in ``out_dir``. ``dtype``: the parameters'
    dtype in the files (buffers keep theirs); ``tokenizer``: a tokenizer file copied in (``tokenizer.model`` /
    ``tokenizer.json``); ``extra``: more entries for ``config.json`` (e.g. the token ids)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    spec = arch_of(model.cfg)
    if getattr(model, "adaptive", False):
        raise BundleError(
            "adaptive-softmax models (model.adaptive_cutoffs, WikiText-103) cannot be exported yet"
        )
    out = Path(out_dir)
    if out.is_dir() and any(out.iterdir()) and not is_bundle(out):
        raise BundleError(
            f"{out} holds files and is not a bundle: a bundle is written into a new or empty folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    state = OrderedDict((k, v.detach()) for k, v in model.state_dict().items())
    tied = _tied_names(model, state)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tensors = OrderedDict()
    for name, t in state.items():
        if name in tied:
            continue
        if dtype is not None and name in params and t.is_floating_point():
            t = t.to(dtype)
        tensors[PREFIX + name] = t.to("cpu").contiguous()
    for old in list(out.glob("model*.safetensors")) + [out / INDEX]:
        old.unlink(missing_ok=True)
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, str(out / filename), metadata={"format": "pt"})
        os.chmod(out / filename, 0o644)  # safetensors writes 0600; a bundle is meant to be shared
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out / INDEX).write_text(json.dumps(index, indent=2))
    stored = next(iter(tensors.values())).dtype if dtype is None else dtype
    token_ids = _write_tokenizer(tokenizer, out, extra or {}) if tokenizer is not None else {}
    config = {
        "model_type": "mega_suite",
        "architectures": ["MegaSuiteForCausalLM"],
        "auto_map": AUTO_MAP,
        "arch": spec.name,
        "suite_config": dataclasses.asdict(model.cfg),
        "vocab_size": model.cfg.vocab_size,
        "tie_word_embeddings": bool(tied),
        "tied_weights": {PREFIX + a: PREFIX + s for a, s in tied.items()},
        "weights_dtype": str(stored).removeprefix("torch."),
        "dtype": "float32",  # the wrapper computes as the suite does (float32 islands); weights cast on load
        "mega_suite_format": FORMAT,
        **token_ids,
        **(extra or {}),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if token_ids:  # generate()'s defaults: the token ids (it stops at EOS) and mode=generate's sampling,
        # temperature 1 over the whole vocabulary (transformers would otherwise keep only the top 50 tokens)
        generation = {**token_ids, "do_sample": True, "temperature": 1.0, "top_k": 0}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    here = Path(__file__).resolve().parent / "hf"
    for name in HF_FILES:
        shutil.copyfile(here / name, out / name)
    return out


def _write_tokenizer(tokenizer: str | os.PathLike, out: Path, extra: dict) -> dict:
    """Copy the run's tokenizer into the bundle and write transformers' tokenizer files beside it; returns the
    token ids for config.json (``extra``'s BOS / EOS ids win over the tokenizer file's defaults)."""
    from datamodules.tokenizer import TextTokenizer, copy_tokenizer
    from mega_suite.models.hf.tokenizer import write_hf_tokenizer

    copy = copy_tokenizer(tokenizer, out)
    bos, eos = extra.get("bos_token_id"), extra.get("eos_token_id")
    if bos is None or eos is None:
        tok = TextTokenizer(copy)
        bos, eos = tok.bos_id if bos is None else bos, tok.eos_id if eos is None else eos
    try:
        return write_hf_tokenizer(copy, out, bos, eos)
    except ImportError as exc:  # transformers is the optional eval group; the bundle still loads in the suite
        warnings.warn(
            f"{out}: no tokenizer.json for AutoTokenizer ({exc}); install the eval group", stacklevel=3
        )
        return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}


def read_config(path: str | os.PathLike):
    """The model config (a registered architecture's dataclass) of a bundle's ``config.json``."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise BundleError(
            f"{path} is not a bundle: no config.json (export one with `python -m mega_suite.training.checkpoint export`)"
        )
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise BundleError(f"{file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return config_from_dict(raw, str(file))


def config_from_dict(raw: dict, where: str = "config.json"):
    if raw.get("mega_suite_format") != FORMAT:
        raise BundleError(f"{where}: mega_suite_format={raw.get('mega_suite_format')!r}, expected {FORMAT}")
    name = raw.get("arch")
    if name not in ARCHS:
        raise BundleError(f"{where}: arch={name!r}, expected one of {sorted(ARCHS)}")
    values = raw.get("suite_config")
    if not isinstance(values, dict):
        raise BundleError(f"{where}: suite_config must be an object of {name} config fields")
    cls = ARCHS[name].config_class
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - valid)
    if unknown:
        raise BundleError(
            f"{where}: suite_config has unknown {name} config keys {unknown}; valid: {sorted(valid)}"
        )
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise BundleError(f"{where}: suite_config is not a valid {name} config: {exc}") from None


def _weight_files(path: Path) -> list[Path]:
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = [path / WEIGHTS]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise BundleError(f"bundle {path} lacks its weight files {missing}")
    return files


def bundle_state(path: str | os.PathLike) -> OrderedDict[str, Tensor]:
    """The model's state dict from a bundle (names without the wrapper's prefix, tied aliases restored)."""
    from safetensors.torch import load_file

    path = Path(path)
    raw = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    tensors: dict[str, Tensor] = {}
    for file in _weight_files(path):
        tensors.update(load_file(str(file)))
    for alias, source in raw.get("tied_weights", {}).items():
        if source in tensors:
            tensors[alias] = tensors[source]
    return OrderedDict((k.removeprefix(PREFIX), v) for k, v in tensors.items())


def load_bundle_into(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a bundle's weights into ``model`` strictly; a BundleError names missing, unexpected or mis-shaped
    tensors (a bundle of another configuration)."""
    state = bundle_state(path)
    problem = state_mismatch(state, model, "bundle", most=5)
    if problem:
        raise BundleError(f"bundle {path} does not fit the model: {problem}")
    model.load_state_dict(state, strict=True)
    return model


def from_pretrained(
    path: str | os.PathLike, device: str | torch.device | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """The suite model of a bundle, in eval mode (its weights cast to the model's dtype, or ``dtype``)."""
    path = Path(path)
    if not path.is_dir():
        raise BundleError(f"{path}: no such bundle folder")
    cfg = read_config(path)
    model = build_model(cfg)
    load_bundle_into(model, path)
    if dtype is not None:
        model.to(dtype)
    if device is not None:
        model.to(device)
    return model.eval()
