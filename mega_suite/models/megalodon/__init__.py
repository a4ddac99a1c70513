"""Megalodon (SPEC §1-§7): the model, read top to bottom in ``model.py``; its config, sizes and FLOPs."""

from __future__ import annotations

from mega_suite.models import ModelSpec, register
from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.models.megalodon.model import MegalodonClassifier, MegalodonLM, build_model
from mega_suite.models.megalodon.presets import PRESETS


def flops_per_token(cfg: MegalodonConfig, seq_len: int = 0) -> float:
    """Training matmul FLOPs per token: 6 x (non-embedding matmul parameters + head) + chunk attention.

    Per block the dense weights are D·Z + 2·D·E + D·D + E·D + (3 or 2)·D·F; causal attention inside a chunk
    sees on average min(C, L)/2 keys per query with Q·K (Z) and P·V (E), 2 FLOPs each, 3x for fwd + bwd.
    """
    d, z, e, f = cfg.model_dim, cfg.z_dim, cfg.value_dim, cfg.ffn_hidden_dim
    block = d * z + 2 * d * e + d * d + e * d + (3 if cfg.swiglu else 2) * d * f
    head = d * cfg.vocab_size
    context = min(cfg.chunk_size, seq_len) if seq_len else cfg.chunk_size
    attention = 2 * (z + e) * context / 2
    return 6 * (cfg.num_layers * block + head) + 3 * cfg.num_layers * attention


SPEC = register(
    ModelSpec(
        name="megalodon",
        config_class=MegalodonConfig,
        build=build_model,
        presets=PRESETS,
        flops_per_token=flops_per_token,
        streaming="exact streaming: CEMA and TimestepNorm states carried, unbounded context (SPEC §7)",
    )
)

__all__ = ["MegalodonClassifier", "MegalodonConfig", "MegalodonLM", "PRESETS", "SPEC", "flops_per_token"]
