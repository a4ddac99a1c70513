"""Llama-2, the Transformer baseline (``model.py``): its config, sizes matched to Megalodon's, its FLOPs.

Every size ``llama_X`` has the width of ``megalodon_X`` and a depth and SwiGLU width chosen by
``matched_config`` so that the parameter counts agree within 3% (the paper compares Megalodon-7B with
Llama2-7B); a test checks each pair. Recipes with ``model.arch=llama`` get the match of whatever Megalodon
the recipe describes, computed the same way.
"""

from __future__ import annotations

from mega_suite.models.llama.model import (
    LlamaConfig,
    LlamaLM,
    count_llama_parameters,
    head_count,
    matched_config,
)
from mega_suite.models.registry import ModelSpec, register

_CTX = dict(max_seq_len=4096)  # Llama 2's context window; recipes set their training length

# matched_config(parameters of megalodon_X, its width, vocabulary and tying), frozen here (tested).
PRESETS: dict[str, dict] = {
    "llama_200m": dict(_CTX, num_layers=12, model_dim=1024, num_heads=8, ffn_hidden_dim=2840),
    "llama_1_3b": dict(_CTX, num_layers=24, model_dim=2048, num_heads=16, ffn_hidden_dim=5488),
    "llama_1_3b_pg19": dict(
        _CTX, num_layers=25, model_dim=2048, num_heads=16, ffn_hidden_dim=5488, share_emb=True
    ),
    "llama_7b": dict(_CTX, num_layers=35, model_dim=4096, num_heads=32, ffn_hidden_dim=11104),
    "llama_cpu_bench": dict(
        _CTX, num_layers=5, model_dim=512, num_heads=8, ffn_hidden_dim=1144, vocab_size=512
    ),
    "llama_debug": dict(
        max_seq_len=64, num_layers=2, model_dim=32, num_heads=2, ffn_hidden_dim=80, vocab_size=64
    ),
}
# The Megalodon size each preset matches (for the test and the docs).
MATCHES = {name: name.replace("llama_", "megalodon_") for name in PRESETS}


def flops_per_token(cfg: LlamaConfig, seq_len: int = 0) -> float:
    """6 x (block and head matmul weights) + causal attention: on average L/2 keys per query, Q·K and P·V
    over D each, 2 FLOPs per multiply-add, 3x for forward and backward."""
    d = cfg.model_dim
    block = 4 * d * d + 3 * d * cfg.ffn_hidden_dim
    context = min(seq_len, cfg.max_seq_len) if seq_len else cfg.max_seq_len
    return 6 * (cfg.num_layers * block + d * cfg.vocab_size) + 3 * cfg.num_layers * 2 * 2 * d * context / 2


SPEC = register(
    ModelSpec(
        name="llama",
        config_class=LlamaConfig,
        build=LlamaLM,
        presets=PRESETS,
        flops_per_token=flops_per_token,
        streaming="sliding window: each token sees between max_seq_len - eval_stride and max_seq_len - 1 "
        "earlier tokens",
    )
)

__all__ = [
    "MATCHES", "PRESETS", "SPEC", "LlamaConfig", "LlamaLM", "count_llama_parameters", "flops_per_token",
    "head_count", "matched_config",
]  # fmt: skip
