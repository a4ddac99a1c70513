"""Megalodon (docs/architecture.md): its config, sizes, builder and FLOPs, registered as an architecture.

The model reads top to bottom in ``layers.py`` -> ``attention.py`` -> ``block.py`` -> ``lm.py`` /
``classifier.py``; ``cache.py`` holds the streaming state and ``decode/`` the one-token decoder.
"""

from __future__ import annotations

from torch import nn

from mega_suite.models.megalodon.classifier import MegalodonClassifier
from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.models.megalodon.lm import MegalodonLM
from mega_suite.models.megalodon.presets import PRESETS
from mega_suite.models.registry import ModelSpec, register


def build_model(cfg: MegalodonConfig) -> nn.Module:
    return MegalodonClassifier(cfg) if cfg.is_classifier else MegalodonLM(cfg)


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
        streaming="exact streaming: CEMA and TimestepNorm states carried, unbounded context (docs/architecture.md#streaming)",
    )
)

__all__ = [
    "MegalodonClassifier", "MegalodonConfig", "MegalodonLM", "PRESETS", "SPEC", "build_model", "flops_per_token",
]  # fmt: skip
