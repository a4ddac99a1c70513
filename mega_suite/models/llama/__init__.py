"""Llama-2, the Transformer baseline (``model.py``): its config, sizes matched to Megalodon's, its FLOPs.

Every size ``llama_X`` has the width of ``megalodon_X`` and a depth and SwiGLU width chosen by
``matched_config`` so that the parameter counts agree within 3% (the paper compares Megalodon-7B with
Llama2-7B); a test checks each pair. Recipes with ``model.arch=llama`` get the match of whatever Megalodon
the recipe describes, computed the same way. This file imports no torch (the registry's rule).
"""

from __future__ import annotations

import importlib

from mega_suite.models.llama.config import LlamaConfig, count_llama_parameters, head_count, matched_config
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


def __getattr__(name: str):
    if name == "LlamaLM":
        return importlib.import_module("mega_suite.models.llama.model").LlamaLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def flops_per_token(cfg: LlamaConfig, seq_len: int = 0) -> float:
    """6 x (block and head matmul weights) + causal attention: on average L/2 keys per query, Q·K and P·V
    over D each, 2 FLOPs per multiply-add, 3x for forward and backward."""
    d = cfg.model_dim
    block = 4 * d * d + 3 * d * cfg.ffn_hidden_dim
    context = min(seq_len, cfg.max_seq_len) if seq_len else cfg.max_seq_len
    return 6 * (cfg.num_layers * block + d * cfg.vocab_size) + 3 * cfg.num_layers * 2 * 2 * d * context / 2


def build_model(cfg: LlamaConfig):
    from mega_suite.models.llama.model import LlamaLM

    return LlamaLM(cfg)


def check_recipe(megalodon, seq_len: int | None) -> None:
    """What a recipe needs for a Llama: a language model without adaptive softmax, with a sequence length."""
    if megalodon.is_classifier:
        raise ValueError("model.arch=llama is a causal language model: it needs task=lm")
    if megalodon.adaptive_cutoffs:
        raise ValueError(
            "model.arch=llama has no adaptive input / softmax (model.adaptive_cutoffs, WikiText-103): use "
            "model.arch=megalodon for this recipe"
        )
    if not seq_len:
        raise ValueError("model.arch=llama needs the data's seq_len (data.options.seq_len) as its window")


def from_recipe(megalodon, seq_len: int | None) -> LlamaConfig:
    """The Llama matched in parameter count to the Megalodon a recipe describes, its window the data's
    ``seq_len``: the paper's controlled comparison on the same recipe."""
    from mega_suite.models.registry import build_on_meta, count_parameters

    check_recipe(megalodon, seq_len)
    target = count_parameters(build_on_meta(megalodon))
    return matched_config(
        target, megalodon.model_dim, megalodon.vocab_size, megalodon.share_emb, max_seq_len=int(seq_len),
        norm_eps=megalodon.norm_eps, dropout=megalodon.dropout,
    )  # fmt: skip


def generate(model, prompt, max_new_tokens: int, compile: bool = False, **kwargs):
    from mega_suite.models.llama.decode import generate as windowed

    if compile:
        raise ValueError("compile=true applies to Megalodon's static decoder; Llama decodes eagerly")
    return windowed(model, prompt, max_new_tokens, **kwargs)


def context_seen(model, position: int) -> int:
    from mega_suite.models.llama.decode import LlamaDecoder

    return position + 1 - LlamaDecoder(model).context_start(position)


def context_note(cfg: LlamaConfig) -> str:
    return (
        f"llama: scored with its window of {cfg.max_seq_len} tokens (sliding window, stride {cfg.stride}: each "
        f"token sees {cfg.max_seq_len - cfg.stride} to {cfg.max_seq_len - 1} earlier tokens; context beyond "
        "the window is not seen)"
    )


SPEC = register(
    ModelSpec(
        name="llama",
        config_class=LlamaConfig,
        build=build_model,
        presets=PRESETS,
        flops_per_token=flops_per_token,
        streaming="sliding window: each token sees between max_seq_len - eval_stride and max_seq_len - 1 "
        "earlier tokens",
        from_recipe=from_recipe,
        check_recipe=check_recipe,
        generate=generate,
        context_seen=context_seen,
        context_note=context_note,
        language_model_only=True,
    )
)

__all__ = [
    "MATCHES", "PRESETS", "SPEC", "LlamaConfig", "LlamaLM", "count_llama_parameters", "flops_per_token",
    "head_count", "matched_config",
]  # fmt: skip
