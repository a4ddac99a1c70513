"""Megalodon (docs/architecture.md): its config, sizes, builder and FLOPs, registered as an architecture.

The model reads top to bottom in ``layers.py`` -> ``attention.py`` -> ``block.py`` -> ``lm.py`` /
``classifier.py``; ``cache.py`` holds the streaming state and ``decode/`` the one-token decoder. This file
imports no torch (the registry's rule): the model's modules are imported when a model is built.
"""

from __future__ import annotations

import importlib

from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.models.megalodon.presets import PRESETS
from mega_suite.models.registry import ModelSpec, register

_LAZY = {
    "MegalodonLM": "mega_suite.models.megalodon.lm",
    "MegalodonClassifier": "mega_suite.models.megalodon.classifier",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_model(cfg: MegalodonConfig):
    from mega_suite.models.megalodon.classifier import MegalodonClassifier
    from mega_suite.models.megalodon.lm import MegalodonLM

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


def generate(model, prompt, max_new_tokens: int, **kwargs):
    from mega_suite.models.megalodon.decode.generation import generate as streaming

    return streaming(model, prompt, max_new_tokens, **kwargs)


def context_note(cfg: MegalodonConfig) -> str:
    return (
        f"megalodon: scored with its full context (exact streaming state, attention chunk {cfg.chunk_size})"
    )


SPEC = register(
    ModelSpec(
        name="megalodon",
        config_class=MegalodonConfig,
        build=build_model,
        presets=PRESETS,
        flops_per_token=flops_per_token,
        streaming="exact streaming: CEMA and TimestepNorm states carried, unbounded context (docs/architecture.md#streaming)",
        from_recipe=lambda cfg, seq_len: cfg,
        check_recipe=lambda cfg, seq_len: None,
        generate=generate,
        context_seen=lambda model, position: position + 1,
        context_note=context_note,
        compiled_decoder=True,
        chunk_parallel=True,
    )
)

__all__ = [
    "MegalodonClassifier", "MegalodonConfig", "MegalodonLM", "PRESETS", "SPEC", "build_model", "flops_per_token",
]  # fmt: skip
