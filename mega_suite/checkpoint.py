"""State dicts in the reference release's format.

Our module tree uses the reference names natively (``layers.{i}.mega.{timenorm,cema,rmsnorm,wz,wv,wr,
wh1,wh2,gamma,beta}.*``, ``layers.{i}.nffn.{norm,fc1,fc2,fc3}.*``, ``embed.weight``, ``output.final_norm.*``,
``output.output.weight``; CEMA ``alpha delta theta gamma omega``; TimestepNorm buffers ``prior_count
prior_mean prior_logv``), so conversion is a checked identity: these functions validate names and shapes
and fail loudly, naming every missing, unexpected or mis-shaped key.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

# Wrappers that training frameworks put in front of names (torch.compile, DDP, Lightning modules).
_PREFIXES = ("_orig_mod.", "module.", "model.")


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix) :], True
    return key


def to_reference(model: nn.Module) -> OrderedDict[str, Tensor]:
    """Our model -> a reference-format state dict (detached tensors, names unchanged)."""
    return OrderedDict((_strip(k), v.detach()) for k, v in model.state_dict().items())


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
    out = OrderedDict((_strip(k), v) for k, v in state_dict.items())
    for key in _DERIVED:
        if key in out:
            _check_rope(out.pop(key), model)
    if model is not None:
        expected = model.state_dict()
        missing = sorted(set(expected) - set(out))
        unexpected = sorted(set(out) - set(expected))
        shapes = [
            f"{k}: checkpoint {tuple(out[k].shape)} vs model {tuple(expected[k].shape)}"
            for k in sorted(set(out) & set(expected))
            if out[k].shape != expected[k].shape
        ]
        if missing or unexpected or shapes:
            raise ValueError(
                "reference state dict does not match the model:\n"
                f"  missing keys: {missing}\n  unexpected keys: {unexpected}\n  shape mismatches: {shapes}"
            )
    return out


def load_reference(model: nn.Module, state_dict: dict[str, Tensor]) -> nn.Module:
    """Load a reference-format state dict strictly (no missing or unexpected keys)."""
    model.load_state_dict(from_reference(state_dict, model), strict=True)
    return model


def load_reference_file(model: nn.Module, path: str) -> nn.Module:
    """Load a checkpoint file's model weights strictly: ``torch.save`` of a state dict, a dict with a
    "model" entry, or one of the suite's Lightning checkpoints (the ``model.`` entries of "state_dict")."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = {k: v for k, v in obj["state_dict"].items() if k.startswith("model.")}
    elif isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        obj = obj["model"]
    return load_reference(model, obj)
