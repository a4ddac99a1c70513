"""TimestepNorm (causal, carried statistics) and the whole-sequence group norm (docs/architecture.md#timestepnorm).

``timestep_norm`` runs the fused Triton kernels (``kernels.timestep_norm.triton``) for CUDA tensors (see
``kernels.dispatch``) and the PyTorch reference (``kernels.timestep_norm.reference``) otherwise: on CPU
and in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.dispatch import use_triton
from kernels.timestep_norm import reference
from kernels.timestep_norm.reference import NormState, group_norm, merge_norm_states
from kernels.timestep_norm.step import timestep_norm_step

__all__ = ["timestep_norm", "timestep_norm_step", "group_norm", "merge_norm_states"]


def timestep_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    num_groups: int,
    eps: float = 1e-5,
    state: NormState | None = None,
    padding_mask: Tensor | None = None,
) -> tuple[Tensor, NormState]:
    """Causal group norm; arguments and shapes as ``kernels.timestep_norm.reference.timestep_norm``.

    x [B, L, D]; weight, bias [D]; state (count [B] int64, mean [B, G], var [B, G]) or None;
    padding_mask [B, L] bool (True = padding). Returns y [B, L, D] and the final state.
    """
    if (
        x.dim() == 3
        and x.shape[1] > 0
        and x.dtype != torch.float64
        and use_triton(x, weight, bias, padding_mask, *(state or ()))
    ):
        from kernels.timestep_norm.triton import timestep_norm as triton_timestep_norm

        return triton_timestep_norm(x, weight, bias, num_groups, eps, state, padding_mask)
    return reference.timestep_norm(x, weight, bias, num_groups, eps, state, padding_mask)
