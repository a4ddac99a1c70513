"""Tiny trained-model stand-ins for the after-training tests (generate, lm_eval, passkey, export): seeded
debug-size Megalodon and Llama models over the committed KJV tokenizer's vocabulary, saved as bundles."""

from __future__ import annotations

from pathlib import Path

import torch

from datamodules.kjv import TOKENIZER
from mega_suite import create_model
from mega_suite.models.bundle import save_bundle

VOCAB = 4096  # the committed KJV SentencePiece model's
# Megalodon: chunk 16, so prompts and documents cross chunks; Llama: window 64, stride 32.
PRESETS = {"megalodon": ("megalodon_debug", {}), "llama": ("llama_debug", {})}


def tiny_model(arch: str, seed: int = 0, **overrides):
    preset, extra = PRESETS[arch]
    torch.manual_seed(seed)
    return create_model(preset, vocab_size=VOCAB, **{**extra, **overrides}).eval()


def tiny_bundle(arch: str, folder: Path, seed: int = 0, **overrides) -> Path:
    return save_bundle(tiny_model(arch, seed, **overrides), folder, tokenizer=TOKENIZER)
