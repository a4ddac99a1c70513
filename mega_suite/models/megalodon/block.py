"""One Megalodon block: the attention layer, then the normalised FFN with the two-hop residual
(docs/architecture.md#the-block)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mega_suite.models.common import autocast_input
from mega_suite.models.megalodon.attention import MegalodonAttention
from mega_suite.models.megalodon.cache import LayerCache
from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.models.megalodon.layers import LayerNorm, Linear
from mega_suite.models.megalodon.lean import dropout, rebuild_linear, recompute_saved, silu_gate_linear


class NormalizedFFN(nn.Module):
    """LayerNorm -> SwiGLU (or SiLU) FFN, optional layer scale (docs/architecture.md#the-block, second half)."""

    def __init__(self, cfg: MegalodonConfig, layer_index: int = 0):
        super().__init__()
        d, f = cfg.model_dim, cfg.ffn_hidden_dim
        self.cfg, self.layer_index = cfg, layer_index
        self.norm = LayerNorm(d, eps=cfg.norm_eps)
        self.fc1 = Linear(d, f, bias=False)
        self.fc2 = Linear(f, d, bias=False)
        self.fc3 = Linear(d, f, bias=False) if cfg.swiglu else None
        self.alpha = nn.Parameter(torch.empty(d)) if cfg.layer_scale else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.alpha is not None:
            nn.init.constant_(self.alpha, 0.1 * 0.5**self.layer_index)

    def forward(self, y: Tensor) -> Tensor:
        u = autocast_input(self.norm(y))  # fc1, fc3 (and their rebuilds) share one stored copy
        b = None if self.fc3 is None else self.fc3(u)
        if self.training and self.cfg.hidden_dropout > 0:
            a = F.silu(self.fc1(u))
            a = a if b is None else a * b
            out = self.fc2(F.dropout(a, self.cfg.hidden_dropout, self.training))
        elif not (torch.is_grad_enabled() and self.cfg.rebuilds_linears(y.shape[1])):
            out = silu_gate_linear(self.fc1(u), b, self.fc2.weight)  # SiLU (and the product) recomputed
        else:  # and fc1 u (fc3 u) rebuilt from u, kept by fc1 and fc3: not stored either
            g = self.fc1(u)
            pre = (g,) if b is None else (g, b)
            fc1 = rebuild_linear(u, self.fc1.weight, None, like=g)
            fc3 = None if b is None else rebuild_linear(u, self.fc3.weight, None, like=b)
            with recompute_saved((pre, lambda: (fc1(),) if fc3 is None else (fc1(), fc3()))):
                out = silu_gate_linear(g, b, self.fc2.weight)
        return out * self.alpha if self.alpha is not None else out


def drop_path(x: Tensor, p: float, training: bool) -> Tensor:
    """Stochastic depth: drop the whole residual branch per sample, rescale the kept ones."""
    if p == 0.0 or not training:
        return x
    keep = torch.empty(x.shape[0], *([1] * (x.dim() - 1)), device=x.device, dtype=x.dtype).bernoulli_(1 - p)
    return x * keep / (1 - p)


class MegalodonBlock(nn.Module):
    """One block with the two-hop residual: out = X + FFN(LN(H + X))."""

    def __init__(self, cfg: MegalodonConfig, layer_index: int = 0):
        super().__init__()
        self.cfg = cfg
        self.mega = MegalodonAttention(cfg)
        self.nffn = NormalizedFFN(cfg, layer_index)
        self.drop_path = cfg.drop_path * layer_index / max(1, cfg.num_layers - 1)

    def forward(
        self, x: Tensor, padding_mask: Tensor | None = None, cache: LayerCache | None = None, pos: int = 0
    ) -> tuple[Tensor, LayerCache | None]:
        p = self.cfg.dropout
        h, cache = self.mega(x, padding_mask, cache, pos)
        y = drop_path(dropout(h, p, self.training), self.drop_path, self.training) + x
        out = x + drop_path(dropout(self.nffn(y), p, self.training), self.drop_path, self.training)
        return out, cache
