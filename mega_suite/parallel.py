"""FSDP2 sharding (torchtitan style): ``fully_shard`` per unit the model names, then the root.

The model declares what to shard and what stays float32 (``fsdp_units()``, ``float32_modules()``; see the
precision policy in ``mega_suite.models.common``); nothing here matches parameter names. Under bf16-mixed:

- each unit (block) all-gathers bf16 parameters and reduce-scatters float32 gradients; it does not cast its
  inputs, so the residual stream stays float32 as under autocast on one device or DDP;
- each float32 island inside a unit (CEMA, norms) is its own unit with float32 parameters;
- the root (embedding, final norm, logits head) keeps float32 parameters: the stream enters the blocks in
  float32 and the logits are float32 (SPEC §1, §5).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

FLOAT32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
BF16_UNITS = MixedPrecisionPolicy(
    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
)


def apply_fsdp(
    model: nn.Module, mesh=None, bf16: bool = False, reshard_after_forward: bool = True
) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (default: the world); ``bf16`` for bf16-mixed training.

    ``model`` provides ``fsdp_units()`` and ``float32_modules()`` (``mega_suite.models.common.Backbone``).
    """
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    islands = {id(m) for m in model.float32_modules()} if bf16 else set()
    for unit in model.fsdp_units():
        for sub in unit.modules():
            if id(sub) in islands and sub is not unit:
                fully_shard(sub, mp_policy=FLOAT32, **kw)
        fully_shard(unit, mp_policy=BF16_UNITS if bf16 else FLOAT32, **kw)
    fully_shard(model, mp_policy=FLOAT32, **kw)
    return model


def uses_model_parallel(module) -> bool:
    """True when the Lightning trainer runs ModelParallelStrategy (our ``trainer.strategy=fsdp``)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer = getattr(module, "_trainer", None)
    return trainer is not None and isinstance(trainer.strategy, ModelParallelStrategy)
