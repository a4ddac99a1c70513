"""Megalodon's layers: TimestepNorm, the plus-one LayerNorm and the complex EMA (docs/architecture.md).

Every module re-initialises itself with ``reset_parameters()``, so models can be built on the meta device.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.cema import cema, cema_coefficients, cema_from_parameters
from kernels.timestep_norm import group_norm, timestep_norm
from mega_suite.models.common import float32_island, init_linear
from mega_suite.models.megalodon.cache import NormState
from mega_suite.models.megalodon.lean import recompute


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        init_linear(self)


@float32_island()
class TimestepNorm(nn.Module):
    """Causal group norm with statistics carried across segments (docs/architecture.md#timestepnorm).

    With ``causal=False`` it is the whole-sequence group norm of the classifier (same parameters).
    The buffers ``prior_count, prior_mean, prior_logv`` are the reference release's initial state
    (count 0, mean 0, log-variance 0); a stream starts from them (``initial_state``), a full pass from
    count 0, which is the same thing while the count is 0.
    """

    def __init__(self, dim: int, num_groups: int, eps: float = 1e-5, causal: bool = True):
        super().__init__()
        self.dim, self.num_groups, self.eps, self.causal = dim, num_groups, eps, causal
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.register_buffer("prior_count", torch.empty((), dtype=torch.int64))
        self.register_buffer("prior_mean", torch.empty(num_groups))
        self.register_buffer("prior_logv", torch.empty(num_groups))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)
        self.prior_count.zero_()
        self.prior_mean.zero_()
        self.prior_logv.zero_()

    def initial_state(self, batch: int) -> NormState:
        dtype = torch.float64 if self.weight.dtype == torch.float64 else torch.float32
        count = self.prior_count.expand(batch).clone()
        mean = self.prior_mean.to(dtype).expand(batch, -1).clone()
        var = self.prior_logv.to(dtype).exp().expand(batch, -1).clone()
        return count, mean, var

    def forward(
        self, x: Tensor, state: NormState | None = None, padding_mask: Tensor | None = None
    ) -> tuple[Tensor, NormState | None]:
        if not self.causal:  # elementwise and two reductions: recomputed in backward, only x is stored
            g, eps = self.num_groups, self.eps
            fn = functools.partial(group_norm, num_groups=g, eps=eps, padding_mask=padding_mask)
            return recompute(fn, x, self.weight, self.bias), None
        if state is None and x.device.type == "cpu":  # the reference's cumulative sums: recomputed in
            # backward, only x stored (the CUDA Triton kernel keeps its own small statistics)
            fn = functools.partial(self._flat_norm, padding_mask=padding_mask)
            y, *new_state = recompute(fn, x, self.weight, self.bias)
            return y, tuple(new_state)
        return timestep_norm(x, self.weight, self.bias, self.num_groups, self.eps, state, padding_mask)

    def _flat_norm(self, x: Tensor, weight: Tensor, bias: Tensor, padding_mask: Tensor | None):
        y, state = timestep_norm(x, weight, bias, self.num_groups, self.eps, None, padding_mask)
        return y, *state

    def extra_repr(self) -> str:
        return f"{self.dim}, groups={self.num_groups}, eps={self.eps}, causal={self.causal}"


@float32_island()
class LayerNorm(nn.LayerNorm):
    """LayerNorm with the plus-one affine: (1 + weight), bias; weight initialised to 0."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, 1 + self.weight, self.bias, self.eps)


@float32_island()
class ComplexEMA(nn.Module):
    """Complex exponential moving average (docs/architecture.md#cema); bidirectional for classification (2D rows)."""

    no_weight_decay_params = ("alpha", "delta", "theta", "gamma", "omega")

    def __init__(self, dim: int, ndim: int = 16, bidirectional: bool = False, method: str = "auto"):
        super().__init__()
        self.dim, self.ndim, self.bidirectional, self.method = dim, ndim, bidirectional, method
        rows = 2 * dim if bidirectional else dim
        self.alpha = nn.Parameter(torch.empty(rows, ndim, 1))
        self.delta = nn.Parameter(torch.empty(rows, ndim, 1))
        self.theta = nn.Parameter(torch.empty(rows, 1, 1))
        self.gamma = nn.Parameter(torch.empty(rows, ndim, 2))
        self.omega = nn.Parameter(torch.empty(dim, 1))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.theta.is_meta:  # no values to fill (and theta's ops would run as torch's slow Python refs)
            return
        nn.init.normal_(self.alpha, 0.0, 0.2)
        nn.init.normal_(self.delta, 0.0, 0.2)
        # theta_d = logit(D^(-pi(d)/D)): base frequencies spread log-uniformly over (1/D, 1).
        rows = self.theta.shape[0]
        for start in range(0, rows, self.dim):
            perm = torch.randperm(self.dim, device="cpu").to(self.theta.device, self.theta.dtype) + 1
            freqs = torch.exp(-perm / self.dim * math.log(self.dim))
            self.theta[start : start + self.dim, 0, 0] = torch.logit(freqs)
        nn.init.normal_(self.gamma[..., 0], 0.0, 1.0)
        nn.init.zeros_(self.gamma[..., 1])
        nn.init.trunc_normal_(self.omega, 0.0, 0.25, -1.0, 1.0)

    def coefficients(self) -> tuple[Tensor, Tensor, Tensor]:
        """(p, q, gamma) of docs/architecture.md#cema, from the parameters as they are now."""
        # Not cached: a parameter's version counter does not move under the fused AdamW step or FSDP2's
        # all-gather, so a cache keyed on it would outlive training steps. One-token decoding packs them per plan.
        return cema_coefficients(self.alpha, self.delta, self.theta, self.gamma)

    def forward(
        self,
        x: Tensor,
        h0: Tensor | None = None,
        padding_mask: Tensor | None = None,
        return_state: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x: [B, L, D] -> (y [B, L, D], h_last [B, D, N] complex or None)."""
        omega = self.omega.squeeze(-1)
        if h0 is None and not return_state and torch.is_grad_enabled():  # training: no complex tensor on CUDA
            params = (self.alpha, self.delta, self.theta, self.gamma, omega)
            y = cema_from_parameters(x, *params, self.bidirectional, padding_mask, self.method)
            return y, None
        p, q, gamma = self.coefficients()
        method = "sequential" if (h0 is not None or return_state) and x.shape[1] <= 16 else self.method
        return cema(
            x, p, q, gamma, omega, h0=h0, bidirectional=self.bidirectional,
            padding_mask=padding_mask, method=method, return_state=return_state,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"{self.dim}, ndim={self.ndim}, bidirectional={self.bidirectional}"
