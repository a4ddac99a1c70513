"""What every architecture shares: the precision policy, the model interface generic code asks, init helpers.

Each architecture package (``mega_suite.models.megalodon``, ``mega_suite.models.llama``) builds its modules
from these; nothing here knows one architecture from another.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

from kernels.recompute import recompute


def init_all(root: nn.Module) -> None:
    """Call every ``reset_parameters`` children first, so a parent's own initialisation wins."""
    for module in reversed(list(root.modules())):
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def state_mismatch(
    state: dict[str, Tensor], model: nn.Module, source: str, most: int | None = None
) -> str | None:
    """What keeps ``state`` from loading strictly into ``model`` (missing, unexpected and mis-shaped tensors,
    the first ``most`` of each), or None; ``source`` names where ``state`` came from."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))[:most]
    unexpected = sorted(set(state) - set(expected))[:most]
    shapes = [
        f"{k}: {source} {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in sorted(set(state) & set(expected))
        if state[k].shape != expected[k].shape
    ][:most]
    if not (missing or unexpected or shapes):
        return None
    return f"missing keys: {missing}; unexpected keys: {unexpected}; shape mismatches: {shapes}"


def init_linear(linear: nn.Linear) -> None:
    """Kaiming normal, a = sqrt(5), fan-in: N(0, 1 / (3 fan_in)); bias 0."""
    nn.init.kaiming_normal_(linear.weight, a=math.sqrt(5))
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


# --------------------------------------------------------------------------- precision policy
#
# docs/architecture.md#the-block: under bf16 autocast the Linear layers (and the attention) compute in bf16, while CEMA (its
# coefficients and FFT / scan), every norm's statistics and the logits stay float32 -- float64 in a float64
# model. The modules that must stay float32 are declared once, with ``@float32_island``: their forward
# runs with autocast off and low-precision inputs upcast. ``Backbone.float32_modules()`` lists them, and
# FSDP2 (mega_suite.distributed.fsdp) gives exactly those modules float32 parameters. The residual stream is float32
# under every strategy: islands return float32, and a bf16 branch added to the float32 stream promotes.

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _upcast(obj):
    if isinstance(obj, Tensor):
        return obj.float() if obj.dtype in _LOW_PRECISION else obj
    if isinstance(obj, tuple):  # a norm state (count, mean, var)
        return tuple(_upcast(o) for o in obj)
    return obj


def _in_float32(method):
    @functools.wraps(method)
    def run_in_float32(self, *args, **kwargs):
        device = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
        if (
            device is None
            or not torch.amp.is_autocast_available(device)
            or not torch.is_autocast_enabled(device)
        ):
            return method(self, *args, **kwargs)
        with torch.autocast(device, enabled=False):
            return method(self, *map(_upcast, args), **{k: _upcast(v) for k, v in kwargs.items()})

    return run_in_float32


def float32_island(*methods: str):
    """Class decorator: the module is a float32 island of the precision policy.

    The named methods (default ``forward``) run with autocast disabled and float16 / bfloat16 tensor
    arguments upcast to float32, so everything inside them computes in the parameters' dtype (float32, or
    float64 in a float64 model). Sets ``float32_island = True`` on the class, which is how
    ``Backbone.float32_modules()`` (and through it FSDP2's mixed-precision policy) finds the islands.
    """

    def decorate(cls):
        for name in methods or ("forward",):
            setattr(cls, name, _in_float32(getattr(cls, name)))
        cls.float32_island = True
        return cls

    return decorate


def is_float32_island(module: nn.Module) -> bool:
    return bool(getattr(module, "float32_island", False))


class Backbone(nn.Module):
    """What generic training code (Lightning modules, FSDP2) asks of a model instead of matching names."""

    layers: nn.ModuleList

    def fsdp_units(self) -> list[nn.Module]:
        """The modules FSDP2 shards one by one before the root: the blocks."""
        return list(self.layers)

    def compile_units(self) -> list[nn.Module]:
        """The modules ``trainer.compile`` compiles one by one (in place): the blocks."""
        return list(self.layers)

    def fsdp_forward_methods(self) -> tuple[str, ...]:
        """Methods besides ``forward`` that training calls on the model itself (the language model's loss
        calls ``forward_hidden`` then ``token_nll``): FSDP2 unshards the root's parameters around them too."""
        return tuple(n for n in ("forward_hidden", "token_nll", "encode") if callable(getattr(self, n, None)))

    def float32_modules(self) -> list[nn.Module]:
        """The float32 islands (``@float32_island``): CEMA, every norm, the logits head."""
        return [m for m in self.modules() if is_float32_island(m)]

    def eval_segment(self) -> int:
        """Tokens per ``forward_hidden`` call when streaming an evaluation (bounds its memory)."""
        raise NotImplementedError(f"{type(self).__name__} does not stream")

    def no_weight_decay(self) -> set[str]:
        """Names of the parameters that ``optim.no_decay_groups`` exempts from weight decay (timm's
        ``no_weight_decay``): every 1-D parameter (biases, norm scales), embeddings, and what a module lists
        in ``no_weight_decay_params`` (CEMA's parameters, the Q/K scales and offsets, learned positions).
        The paper recipes decay everything (docs/architecture.md#paper-vs-reference-code); this is the documented option."""
        names = set()
        for prefix, module in self.named_modules():
            listed = getattr(module, "no_weight_decay_params", ())
            for name, p in module.named_parameters(recurse=False):
                if p.dim() < 2 or isinstance(module, nn.Embedding) or name in listed:
                    names.add(f"{prefix}.{name}" if prefix else name)
        return names


@float32_island()
class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · (1 + weight), weight initialised to 0 (Megalodon's plus-one convention,
    docs/architecture.md#the-block); with ``plus_one=False`` · weight, initialised to 1 (Llama's). Statistics in float32."""

    def __init__(self, dim: int, eps: float = 1e-5, plus_one: bool = True, lean: bool = False):
        super().__init__()
        # lean: only x is stored for backward, the normalisation is recomputed there (kernels.recompute);
        # for a norm whose output the next Linear layers keep anyway
        self.eps, self.plus_one, self.lean = eps, plus_one, lean
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 0.0 if self.plus_one else 1.0)

    def forward(self, x: Tensor) -> Tensor:
        # the weight is read here, inside the module's own forward: under FSDP2 that is the unsharded one
        if self.lean:
            return recompute(self._normalise, x, self.weight)
        return self._normalise(x, self.weight)

    def _normalise(self, x: Tensor, weight: Tensor) -> Tensor:
        xf = x.float() if x.dtype in _LOW_PRECISION else x  # bf16-true models too: float32 statistics
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (y * (1 + weight) if self.plus_one else y * weight).to(x.dtype)


@float32_island()
class OutputProjection(nn.Linear):
    """Hidden states -> logits without bias, computed in float32 (float64 for a float64 model) under
    autocast: the logits are not computed in bf16 and cast afterwards (docs/architecture.md#language-model)."""

    def reset_parameters(self) -> None:
        init_linear(self)


@functools.lru_cache(maxsize=64)
def _inv_freq(d: int, base: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    return base ** (-torch.arange(0, d, 2, device=device, dtype=dtype) / d)


def rope(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """Rotary embedding on interleaved pairs (x[2i], x[2i+1]). x: [B, L, h, d]; positions: [L]."""
    d = x.shape[-1]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    angle = positions.to(dtype).unsqueeze(-1) * _inv_freq(d, base, x.device, dtype)  # [L, d/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    xr = x.to(dtype).unflatten(-1, (d // 2, 2))
    x0, x1 = xr[..., 0], xr[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


def autocast_input(x: Tensor) -> Tensor:
    """``x`` cast once to the dtype autocast would give a Linear reading it (unchanged outside autocast).

    Autocast casts an activation per op, so each Linear reading a float32 ``x`` stores its own bf16 copy for
    backward, and a rebuild closure holding ``x`` would keep the float32 one alive beside them. Cast once,
    every Linear (and the rebuild) reads, and stores, the same tensor; the values are the same."""
    device = x.device.type
    if (
        x.dtype == torch.float32
        and torch.amp.is_autocast_available(device)
        and torch.is_autocast_enabled(device)
    ):
        dtype = torch.get_autocast_dtype(device)
        return x.to(dtype) if dtype != torch.float32 else x
    return x
