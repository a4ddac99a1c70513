"""Megalodon for classification (LRA, speech, images): an encoder, bidirectional blocks with whole-sequence
group norm, a final group norm and a pooled head (docs/architecture.md#classifier)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mega_suite.models.common import Backbone, float32_island, init_all
from mega_suite.models.megalodon.block import MegalodonBlock
from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.models.megalodon.layers import Linear, TimestepNorm
from mega_suite.models.megalodon.lean import dropout


class TokenEncoder(nn.Module):
    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.model_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.model_dim**-0.5
        nn.init.trunc_normal_(self.embed.weight, 0.0, std, -3 * std, 3 * std)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 2:
            raise ValueError(f"token input must be [B, L] int64, got shape {tuple(x.shape)}")
        out = self.embed(x)
        return out * math.sqrt(self.cfg.model_dim) if self.cfg.scale_emb else out


class ScalarEncoder(nn.Module):
    """Pixel or audio sample x -> x * w + b (a vector per step)."""

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.model_dim))
        self.bias = nn.Parameter(torch.empty(cfg.model_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, 1.0)
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 2:
            raise ValueError(f"scalar input must be [B, L] float, got shape {tuple(x.shape)}")
        return x.unsqueeze(-1).to(self.weight.dtype) * self.weight + self.bias


class PatchEncoder(nn.Module):
    """16x16 patch embedding plus learned positions (ImageNet): [B, C, H, W] -> [B, H*W/P^2, D]."""

    no_weight_decay_params = ("pos",)

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        self.cfg = cfg
        self.proj = nn.Conv2d(cfg.in_chans, cfg.model_dim, cfg.patch_size, stride=cfg.patch_size)
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.pos = nn.Parameter(torch.empty(1, self.num_patches, cfg.model_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.proj.reset_parameters()
        nn.init.trunc_normal_(self.pos, 0.0, 0.02)

    def forward(self, x: Tensor) -> Tensor:
        side = self.cfg.image_size
        if x.dim() != 4 or x.shape[1] != self.cfg.in_chans or x.shape[-2:] != (side, side):
            raise ValueError(
                f"image input must be [B, {self.cfg.in_chans}, {side}, {side}], got shape {tuple(x.shape)}"
            )
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


ENCODERS = {"token": TokenEncoder, "scalar": ScalarEncoder, "patch": PatchEncoder}


@float32_island()
class ClassificationHead(nn.Module):
    """Masked mean over valid steps -> Linear(D, 2D) -> GELU -> dropout -> Linear(2D, classes)."""

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        width = cfg.model_dim * (2 if cfg.dual_input else 1)
        self.dropout = cfg.dropout
        self.fc1 = Linear(width, 2 * cfg.model_dim)
        self.fc2 = Linear(2 * cfg.model_dim, cfg.num_classes, bias=False)

    def forward(self, pooled: Tensor) -> Tensor:
        h = F.dropout(F.gelu(self.fc1(pooled)), self.dropout, self.training)
        out = self.fc2(h)
        return out if out.dtype == torch.float64 else out.float()


class MegalodonClassifier(Backbone):
    """Encoder -> bidirectional blocks with group norm -> final group norm -> pooled head (docs/architecture.md#classifier)."""

    def __init__(self, cfg: MegalodonConfig):
        super().__init__()
        if not cfg.is_classifier:
            raise ValueError("MegalodonClassifier needs num_classes > 0")
        self.cfg = cfg
        self.encoder = ENCODERS[cfg.input_type](cfg)
        self.layers = nn.ModuleList(MegalodonBlock(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = TimestepNorm(cfg.model_dim, cfg.norm_num_groups, cfg.norm_eps, causal=False)
        self.head = ClassificationHead(cfg)
        self.gradient_checkpointing = False

    def init_weights(self) -> None:
        """Re-initialise every parameter and buffer (after ``to_empty`` from the meta device)."""
        init_all(self)

    def encode(self, x: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """Inputs -> pooled features [B, D] (masked mean over valid steps)."""
        h = self.encoder(x)
        if padding_mask is not None:
            if padding_mask.shape != h.shape[:2]:
                raise ValueError(
                    f"padding_mask must be {tuple(h.shape[:2])}, got {tuple(padding_mask.shape)}"
                )
            h = h.masked_fill(padding_mask.unsqueeze(-1), 0.0)
        h = dropout(h, self.cfg.dropout, self.training)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                h = torch.utils.checkpoint.checkpoint(
                    lambda t, m=layer: m(t, padding_mask)[0], h, use_reentrant=False
                )
            else:
                h, _ = layer(h, padding_mask)
        h, _ = self.final_norm(h, padding_mask=padding_mask)
        if padding_mask is None:
            return h.mean(1)
        valid = (~padding_mask).unsqueeze(-1).to(h.dtype)
        return (h * valid).sum(1) / valid.sum(1).clamp(min=1)

    def forward(
        self,
        x: Tensor,
        padding_mask: Tensor | None = None,
        x2: Tensor | None = None,
        padding_mask2: Tensor | None = None,
    ) -> Tensor:
        """[B, L] tokens / [B, L] scalars / [B, C, H, W] images -> logits [B, classes] (float32).

        Retrieval (``dual_input``): both documents share weights; the head sees [u, v].
        """
        u = self.encode(x, padding_mask)
        if self.cfg.dual_input:
            if x2 is None:
                raise ValueError("a dual_input (retrieval) classifier needs the second document x2")
            u = torch.cat([u, self.encode(x2, padding_mask2)], dim=-1)
        return self.head(u)
