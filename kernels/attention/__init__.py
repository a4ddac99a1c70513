"""Chunked normalised attention (docs/architecture.md#normalised-attention).

``chunk_attention`` picks one implementation per call (:func:`attention_path`):

- CPU tensors, or the references forced (``kernels.dispatch``): the PyTorch reference
  (``kernels.attention.reference``, DropKey through the attention mask).
- CUDA, value heads wider than 256: attention by materialised probabilities (``kernels.attention.probs``:
  cuBLAS GEMMs around fused Triton softmax kernels).
- CUDA, dv <= 256 with dk == dv, no key padding and no DropKey: SDPA per chunk (``kernels.attention.sdpa``).
- CUDA otherwise: the fused flash-style Triton kernel (``kernels.attention.triton``).

The choice can be forced for benchmarks: ``path=`` per call, :func:`force_path`, or
``MEGA_SUITE_ATTENTION=probs|fused|sdpa`` in the environment (``auto`` or unset: the rules above).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from kernels import dispatch
from kernels.attention import reference
from kernels.attention.reference import attention_with_cache
from kernels.attention.step import attention_step

__all__ = [
    "PATHS",
    "attention_path",
    "chunk_attention",
    "attention_with_cache",
    "attention_step",
    "force_path",
    "fused_eligible",
]

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_QK_HEAD_DIM = 256  # the fused kernel keeps a [BLOCK, dk] tile per program (kernels.attention.triton)
# Thresholds of the GPU paths are unmeasured until a GPU run (bench/attention_gpu.py times them side by side).
_MAX_FUSED_DV = 256  # wider value heads: materialised probabilities instead of per-value-tile recompute
_MAX_SDPA_WIDTH = 256
PATHS = ("probs", "fused", "sdpa")
_FORCED_PATH: str | None = None


def fused_eligible(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the fused kernel supports these inputs, the device aside: q, k, v [B, L, h, d] in one of
    float16 / bfloat16 / float32 (one dtype for all three) and a Q/K head width <= 256."""
    return _gpu_dtypes(q, k, v) and q.shape[-1] <= _MAX_QK_HEAD_DIM


def _gpu_dtypes(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return q.dtype in _TRITON_DTYPES and k.dtype == q.dtype == v.dtype and q.dim() == 4


def force_path(path: str | None) -> None:
    """Run every eligible CUDA call on ``path`` (one of ``PATHS``); None: back to the environment / rules."""
    if path is not None and path not in PATHS:
        raise ValueError(f"attention path must be one of {PATHS} or None, got {path!r}")
    global _FORCED_PATH
    _FORCED_PATH = path


def _requested_path() -> str | None:
    if _FORCED_PATH is not None:
        return _FORCED_PATH
    value = os.environ.get("MEGA_SUITE_ATTENTION", "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in PATHS:
        raise ValueError(f"MEGA_SUITE_ATTENTION must be one of {('auto', *PATHS)}, got {value!r}")
    return value


def attention_path(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    *,
    path: str | None = None,
    on_gpu: bool | None = None,
) -> str:
    """Which implementation ``chunk_attention`` runs: ``"reference"``, ``"probs"``, ``"sdpa"`` or ``"fused"``.

    ``path`` (else :func:`force_path`, else ``MEGA_SUITE_ATTENTION``) forces a GPU path; a forced path the
    inputs do not fit raises. ``on_gpu`` defaults to ``kernels.dispatch.use_triton(q, k, v)`` (CUDA tensors,
    Triton installed, references not forced); tests pass True to check the rules on CPU tensors.
    """
    if on_gpu is None:
        on_gpu = dispatch.use_triton(q, k, v)
    if not on_gpu or not _gpu_dtypes(q, k, v):
        return "reference"
    dk, dv = q.shape[-1], v.shape[-1]
    plain = key_padding_mask is None and dropout_p == 0.0
    fits = {
        "probs": True,
        "fused": dk <= _MAX_QK_HEAD_DIM,
        "sdpa": plain and dk == dv and dv <= _MAX_SDPA_WIDTH,
    }
    requested = path if path is not None else _requested_path()
    if requested is not None:
        if requested not in PATHS:
            raise ValueError(f"attention path must be one of {PATHS}, got {requested!r}")
        if not fits[requested]:
            raise ValueError(
                f"attention path {requested!r} does not fit dk {dk}, dv {dv}, "
                f"key padding {key_padding_mask is not None}, dropout_p {dropout_p}: "
                "fused needs dk <= 256; sdpa needs dk == dv <= 256, no key padding and no DropKey"
            )
        return requested
    if dv > _MAX_FUSED_DV:
        return "probs"
    if fits["sdpa"]:
        return "sdpa"
    return "fused" if fits["fused"] else "probs"


def chunk_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    chunk_size: int,
    causal: bool,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    *,
    path: str | None = None,
) -> Tensor:
    """Softmax attention inside independent chunks of ``chunk_size`` tokens.

    Args:
        q, k: [B, L, h, dk] (RoPE already applied, positions restarting per chunk).
        v: [B, L, h, dv]; dv may differ from dk.
        chunk_size: C; a length that is not a multiple of C is padded internally.
        causal: mask keys after the query inside each chunk.
        key_padding_mask: [B, L] bool, True = padding key.
        dropout_p: DropKey rate (pre-softmax logits masked with this probability, no rescaling).
        path: force a GPU implementation (see :func:`attention_path`); CPU tensors always run the reference.

    Returns:
        [B, L, h, dv]; a query with no valid key outputs zeros.
    """
    choice = attention_path(q, k, v, key_padding_mask, dropout_p, path=path)
    if choice == "probs":
        from kernels.attention import probs  # imports Triton only when it runs

        return probs.chunk_attention(q, k, v, chunk_size, causal, key_padding_mask, dropout_p)
    if choice == "sdpa":
        from kernels.attention import sdpa

        return sdpa.chunk_attention(q, k, v, chunk_size, causal)
    if choice == "fused":
        from kernels.attention import triton as fused

        return fused.chunk_attention(q, k, v, chunk_size, causal, key_padding_mask, dropout_p)
    return reference.chunk_attention(q, k, v, chunk_size, causal, key_padding_mask, dropout_p)
