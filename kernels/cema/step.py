"""One CEMA step for one new token (decoding), beside the sequence forms in ``reference.py`` and ``triton.py``.

h' = p x + q h and y = Re(Σ_n γ_n h'_n) + ω x (docs/architecture.md#cema), with the coefficients computed once
per decode plan. Two forms of the state: complex [B, D, N], or (Re, Im) pairs [B, D, N, 2] for compilers
without complex support (Inductor fuses the real form into a few loops).
"""

from __future__ import annotations

import torch
from torch import Tensor


def cema_token_step(
    px: Tensor, x: Tensor, q: Tensor, gamma_conj: Tensor, omega: Tensor, state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Complex state. px = p ⊙ x [B, D, N] (real), x [B, D], q [D, N] complex, ``gamma_conj`` = conj(γ) [D, N]
    (``vecdot`` conjugates its first argument, so this gives Σ γ h), omega [D], state [B, D, N] complex or
    None (zeros) -> (y [B, D], new state)."""
    new = px.to(q.dtype) if state is None else torch.addcmul(px, q, state)
    return torch.addcmul(torch.linalg.vecdot(gamma_conj, new).real, omega, x), new


def cema_token_step_real(
    px: Tensor, x: Tensor, q_ri: Tensor, gamma_ri: Tensor, omega: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """(Re, Im) pairs: q_ri, gamma_ri [D, N, 2], state [B, D, N, 2]. With q = a + ib and γ = c + id:
    Re h' = p x + a Re h − b Im h, Im h' = a Im h + b Re h, Re(γ h') = c Re h' − d Im h'."""
    hr, hi = state.unbind(-1)
    a, b = q_ri.unbind(-1)
    new_r = px + a * hr - b * hi
    new_i = a * hi + b * hr
    c, d = gamma_ri.unbind(-1)
    y = (c * new_r - d * new_i).sum(-1) + omega * x
    return y, torch.stack((new_r, new_i), -1)
