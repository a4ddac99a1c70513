"""Registry of named Megalodon sizes (SPEC §9), timm style: ``create_model("megalodon_7b", **overrides)``.

Language-model presets are the reference release's (200M, 1.3B, 1.3B-pg19) and the paper's 7B run.
Task presets are the small-task table of SPEC §9; their ``vocab_size`` is a placeholder that the
experiment runner replaces by the data module's. The table's "drop" is the residual ``dropout``; hidden and
attention dropout stay 0 as in Mega's LRA scripts (override ``model.attention_dropout`` for DropKey). Norm group counts of the task presets are not given by
the paper; we use groups of 4-6 channels (``norm_num_groups`` below), a documented choice.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
from torch import nn

from mega_suite.config import MegalodonConfig

_LM = dict(cema_ndim=16, norm_eps=1e-5, dropout=0.0, hidden_dropout=0.0, attention_dropout=0.0)

PRESETS: dict[str, dict] = {
    # --- language models (SPEC §9) ---
    "megalodon_200m": dict(
        _LM,
        num_layers=12,
        model_dim=1024,
        num_heads=1,
        z_dim=256,
        value_dim=2048,
        ffn_hidden_dim=2560,
        swiglu=False,
        chunk_size=2048,
        norm_num_groups=32,
        vocab_size=32000,
    ),
    "megalodon_1_3b": dict(
        _LM,
        num_layers=24,
        model_dim=2048,
        num_heads=2,
        z_dim=512,
        value_dim=4096,
        ffn_hidden_dim=4864,
        swiglu=False,
        chunk_size=2048,
        norm_num_groups=64,
        vocab_size=32000,
    ),
    "megalodon_1_3b_pg19": dict(
        _LM,
        num_layers=24,
        model_dim=2048,
        num_heads=2,
        z_dim=512,
        value_dim=4096,
        ffn_hidden_dim=3584,
        swiglu=True,
        chunk_size=2048,
        norm_num_groups=64,
        vocab_size=32000,
        scale_emb=True,
        share_emb=True,
    ),
    "megalodon_7b": dict(
        _LM,
        num_layers=32,
        model_dim=4096,
        num_heads=4,
        z_dim=1024,
        value_dim=8192,
        ffn_hidden_dim=8192,
        swiglu=True,
        chunk_size=4096,
        norm_num_groups=64,
        vocab_size=32000,
        rope_base=100000.0,
    ),
    # The CPU speed-bar model of the brief: 4 layers, D 512, 14.6M parameters (V = 512, untied).
    "megalodon_cpu_bench": dict(
        _LM,
        num_layers=4,
        model_dim=512,
        num_heads=1,
        z_dim=128,
        value_dim=1024,
        ffn_hidden_dim=1024,
        swiglu=True,
        chunk_size=2048,
        norm_num_groups=64,
        vocab_size=512,
    ),
    "megalodon_debug": dict(
        _LM,
        num_layers=2,
        model_dim=32,
        num_heads=2,
        z_dim=16,
        value_dim=32,
        ffn_hidden_dim=64,
        swiglu=True,
        cema_ndim=4,
        chunk_size=16,
        norm_num_groups=4,
        vocab_size=64,
    ),
    "megalodon_wt103": dict(
        num_layers=16,
        model_dim=1024,
        num_heads=1,
        z_dim=256,
        value_dim=2048,
        ffn_hidden_dim=2048,
        chunk_size=2048,
        norm_num_groups=32,
        dropout=0.3,
        vocab_size=267744,
        adaptive_cutoffs=[20000, 60000],  # adaptive input + softmax, factor 4, tied
        adaptive_factor=4.0,
    ),
    # --- classification tasks (SPEC §9 small-task table; C = full length unless "-chunk") ---
    "lra_listops": dict(
        num_layers=6,
        model_dim=80,
        z_dim=64,
        value_dim=160,
        ffn_hidden_dim=160,
        chunk_size=2000,
        norm_num_groups=16,
        dropout=0.1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_classes=10,
        input_type="token",
        vocab_size=32,
    ),
    "lra_text": dict(
        num_layers=4,
        model_dim=128,
        z_dim=64,
        value_dim=256,
        ffn_hidden_dim=256,
        chunk_size=4000,
        norm_num_groups=32,
        dropout=0.1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_classes=2,
        input_type="token",
        vocab_size=260,
    ),
    "lra_retrieval": dict(
        num_layers=6,
        model_dim=128,
        z_dim=64,
        value_dim=256,
        ffn_hidden_dim=256,
        chunk_size=4000,
        norm_num_groups=32,
        dropout=0.1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_classes=2,
        input_type="token",
        vocab_size=260,
        dual_input=True,
    ),
    "lra_image": dict(
        num_layers=8,
        model_dim=160,
        z_dim=96,
        value_dim=320,
        ffn_hidden_dim=320,
        chunk_size=1024,
        norm_num_groups=32,
        num_classes=10,
        input_type="scalar",
    ),
    "lra_pathfinder": dict(
        num_layers=6,
        model_dim=128,
        z_dim=64,
        value_dim=256,
        ffn_hidden_dim=256,
        chunk_size=1024,
        norm_num_groups=32,
        num_classes=2,
        input_type="scalar",
    ),
    "lra_pathx": dict(
        num_layers=4,
        model_dim=64,
        z_dim=32,
        value_dim=128,
        ffn_hidden_dim=128,
        chunk_size=16384,
        norm_num_groups=16,
        num_classes=2,
        input_type="scalar",
    ),
    "sc_raw": dict(
        num_layers=6,
        model_dim=60,
        z_dim=30,
        value_dim=120,
        ffn_hidden_dim=120,
        chunk_size=1000,
        norm_num_groups=12,
        num_classes=10,
        input_type="scalar",
    ),
    "imagenet_90m": dict(
        num_layers=12,
        model_dim=768,
        z_dim=256,
        value_dim=1536,
        ffn_hidden_dim=1536,
        chunk_size=196,
        norm_num_groups=64,
        drop_path=0.3,
        num_classes=1000,
        input_type="patch",
        image_size=224,
        patch_size=16,
        swiglu=False,
    ),
}
# "-chunk" variants of the LRA table: C = 128 (Path-X 4096).
for _task in ("lra_listops", "lra_text", "lra_retrieval", "lra_image", "lra_pathfinder", "lra_pathx"):
    PRESETS[f"{_task}_chunk"] = dict(PRESETS[_task], chunk_size=4096 if _task == "lra_pathx" else 128)

_FIELDS = {f.name for f in fields(MegalodonConfig)}


def list_models() -> list[str]:
    return sorted(PRESETS)


def get_config(name: str, **overrides) -> MegalodonConfig:
    """The preset's configuration with ``overrides`` applied (unknown names and keys are errors)."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known presets: {', '.join(list_models())}")
    unknown = sorted(set(overrides) - _FIELDS)
    if unknown:
        raise KeyError(f"unknown model config keys {unknown}; valid keys: {', '.join(sorted(_FIELDS))}")
    return replace(MegalodonConfig(**PRESETS[name]), **overrides)


def create_model(name: str, device: str | torch.device | None = None, **overrides) -> nn.Module:
    """Build a registered model. ``device="meta"`` builds without allocating (e.g. the 7B)."""
    from mega_suite.model import build_model

    cfg = get_config(name, **overrides)
    if device is None:
        return build_model(cfg)
    with torch.device(device):
        return build_model(cfg)


def count_parameters(model: nn.Module) -> int:
    """Parameters counted once (tied weights once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
