"""The Llama baseline's configuration and its size matched to a Megalodon's (no torch: read when a recipe is
checked, before anything heavy is imported)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LlamaConfig:
    num_layers: int = 12  # decoder blocks
    model_dim: int = 1024  # D, residual width
    num_heads: int = 8  # attention heads (head width D / h)
    ffn_hidden_dim: int = 2816  # F, SwiGLU width
    vocab_size: int = 32000  # V
    max_seq_len: int = 4096  # the context window: training length, and the sliding window in evaluation
    rope_base: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm eps
    share_emb: bool = False  # tie the output projection to the embedding
    dropout: float = 0.0  # residual and embedding dropout (the paper's runs: 0)
    eval_stride: int = 0  # sliding-window stride of streaming evaluation; 0 = max_seq_len // 2

    def __post_init__(self) -> None:
        checks = [
            (self.model_dim % self.num_heads == 0, "model_dim", "divisible by num_heads"),
            ((self.model_dim // self.num_heads) % 2 == 0, "num_heads", "an even head width (RoPE pairs)"),
            (self.max_seq_len >= 2, "max_seq_len", ">= 2"),
            (0 <= self.eval_stride < self.max_seq_len, "eval_stride", "in [0, max_seq_len)"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise ValueError(f"model.{name}={getattr(self, name)!r} is invalid: expected {expected}")

    @property
    def head_dim(self) -> int:
        return self.model_dim // self.num_heads

    @property
    def stride(self) -> int:
        return self.eval_stride or self.max_seq_len // 2


# --------------------------------------------------------------------------- size matching


def count_llama_parameters(cfg: LlamaConfig) -> int:
    """Embedding (and untied output) V·D, per block 4D² (attention) + 3DF (SwiGLU) + 2D (norms), final D."""
    d, f = cfg.model_dim, cfg.ffn_hidden_dim
    embeddings = cfg.vocab_size * d * (1 if cfg.share_emb else 2)
    return embeddings + cfg.num_layers * (4 * d * d + 3 * d * f + 2 * d) + d


def head_count(model_dim: int) -> int:
    """Llama's head width: 128 from D = 1024 up (Llama-2 7B: 32 heads of 128), 64 from 256, else D / 2."""
    width = 128 if model_dim >= 1024 else 64 if model_dim >= 256 else max(2, model_dim // 2)
    return max(1, model_dim // width)


def matched_config(target_params: int, model_dim: int, vocab_size: int, share_emb: bool, **kw) -> LlamaConfig:
    """The Llama of width ``model_dim`` whose parameter count is closest to ``target_params`` with an FFN
    width near Llama's 8/3 · D: for each depth the SwiGLU width F (a multiple of 8) that fills the budget,
    keeping the depth whose F / D is closest to 8/3 (the paper matches Megalodon-7B to Llama2-7B this way:
    same width, similar depth)."""
    d = model_dim
    fixed = vocab_size * d * (1 if share_emb else 2) + d
    best = None
    for layers in range(1, 200):
        f = round((target_params - fixed - layers * (4 * d * d + 2 * d)) / (3 * d * layers) / 8) * 8
        if f < 8:
            break
        score = abs(f / d - 8 / 3)
        if best is None or score < best[0]:
            best = (score, layers, f)
    if best is None:
        raise ValueError(
            f"no Llama of width {d} and vocabulary {vocab_size} fits {target_params:,} parameters: its "
            "embeddings alone are larger"
        )
    _, layers, f = best
    return LlamaConfig(
        num_layers=layers, model_dim=d, num_heads=head_count(d), ffn_hidden_dim=f, vocab_size=vocab_size,
        share_emb=share_emb, **kw,
    )  # fmt: skip
