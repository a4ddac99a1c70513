"""Model configuration: one dataclass for every Megalodon variant (language model and classifier)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MegalodonConfig:
    # --- backbone (docs/architecture.md) ---
    num_layers: int = 12  # number of Megalodon blocks
    model_dim: int = 1024  # D, residual width
    num_heads: int = 1  # h, attention heads (Q/K head width Z/h, value head width E/h)
    z_dim: int = 256  # Z, shared query/key width
    value_dim: int = 2048  # E, value width
    ffn_hidden_dim: int = 2560  # F, FFN width
    swiglu: bool = False  # SwiGLU FFN (W1, W2, W3) instead of SiLU (W1, W2)
    cema_ndim: int = 16  # N, CEMA order
    norm_num_groups: int = 32  # G, groups of TimestepNorm / group norm
    chunk_size: int = 2048  # C, attention chunk size
    norm_eps: float = 1e-5  # eps of every norm
    rope_base: float = 10000.0  # RoPE base (the paper's 7B run: 1e5)
    layer_scale: bool = False  # per-channel FFN output scale alpha, init 0.1 * 0.5**layer
    dropout: float = 0.0  # dropout on the residual branches
    hidden_dropout: float = 0.0  # dropout_h inside the attention layer and FFN
    attention_dropout: float = 0.0  # dropout on attention probabilities
    drop_path: float = 0.0  # stochastic depth rate (classification, e.g. ImageNet 0.3), linear over depth
    cema_method: str = "auto"  # auto | fft | chunked | sequential
    # auto | always | never: whenever autograd records, rebuild X̂ W_v + b, M W_r + b and the FFN's u W_1
    # (u W_3) in backward from inputs kept anyway, instead of storing them (2E + F or 2E + 2F floats per token
    # and layer, one GEMM each); auto: when that is <= 5% of the block's FLOPs (``rebuilds_linears``)
    recompute_linears: str = "auto"
    # --- language model (docs/architecture.md#language-model) ---
    vocab_size: int = 32000  # V
    scale_emb: bool = False  # multiply embeddings by sqrt(D)
    share_emb: bool = False  # tie the output projection to the embedding
    adaptive_cutoffs: list[int] = field(
        default_factory=list
    )  # adaptive input + softmax bands, e.g. [20000, 60000]
    adaptive_factor: float = 4.0  # width divisor per band (adaptive input / softmax)
    # --- classification (docs/architecture.md#classifier) ---
    num_classes: int = 0  # > 0 makes a classifier
    input_type: str = "token"  # token | scalar | patch
    image_size: int = 224  # patch encoder: input image side
    patch_size: int = 16  # patch encoder: patch side
    in_chans: int = 3  # patch encoder: image channels
    dual_input: bool = False  # retrieval: encode two documents, classify [u, v]

    def __post_init__(self) -> None:
        checks = [
            (self.model_dim % self.norm_num_groups == 0, "model_dim", "divisible by norm_num_groups"),
            (self.z_dim % self.num_heads == 0, "z_dim", "divisible by num_heads"),
            (self.value_dim % self.num_heads == 0, "value_dim", "divisible by num_heads"),
            ((self.z_dim // self.num_heads) % 2 == 0, "z_dim", "z_dim / num_heads even (RoPE pairs)"),
            (self.chunk_size >= 1, "chunk_size", ">= 1"),
            (self.input_type in ("token", "scalar", "patch"), "input_type", "token, scalar or patch"),
            (
                self.cema_method in ("auto", "fft", "chunked", "sequential"),
                "cema_method",
                "auto|fft|chunked|sequential",
            ),
            (
                self.recompute_linears in ("auto", "always", "never"),
                "recompute_linears",
                "auto|always|never",
            ),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(
                    f"model.{name}={getattr(self, name)!r} is invalid: expected {expected} "
                    f"(model_dim={self.model_dim}, num_heads={self.num_heads}, norm_num_groups={self.norm_num_groups})"
                )

    @property
    def is_classifier(self) -> bool:
        return self.num_classes > 0

    def rebuilds_linears(self, length: int) -> bool:
        """Whether training on ``length`` tokens rebuilds the narrow-input Linears' outputs in backward
        (``recompute_linears``; auto: when the extra GEMMs are <= 5% of the block's training FLOPs).

        Per token, forward: Linears 2 (D Z + 3 D E + D² + k D F) with k = 3 for SwiGLU, else 2; attention
        2 n (Z + E) over n keys (min(L, C), half of it when causal). Training is about 3x forward for the
        Linears and 4x for attention (its backward recomputes the probabilities). The rebuild is
        2 D (2 E + (k - 1) F): under 2% for the LRA recipes, 14-18% for the language models (what it costs
        in step time: bench/reports/2026-11-24-training-memory.md)."""
        if self.recompute_linears != "auto":
            return self.recompute_linears == "always"
        d, z, e, f = self.model_dim, self.z_dim, self.value_dim, self.ffn_hidden_dim
        k = 3 if self.swiglu else 2
        n = min(length, self.chunk_size) / (1 if self.is_classifier else 2)
        linears = 2 * (d * z + 3 * d * e + d * d + k * d * f)
        attention = 2 * n * (z + e)
        rebuild = 2 * d * (2 * e + (k - 1) * f)
        return rebuild <= 0.05 * (3 * linears + 4 * attention)
