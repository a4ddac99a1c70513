"""FSDP2 sharding of Megalodon (torchtitan style): ``fully_shard`` per block, then the root.

Under bf16 mixed precision the blocks compute with bf16 parameters and reduce gradients in float32, while
CEMA and every norm are their own FSDP units with float32 parameters (their coefficients, scans and
statistics must stay float32, SPEC §1).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from mega_suite.model import ComplexEMA, LayerNorm, RMSNorm, TimestepNorm

FLOAT32_MODULES = (ComplexEMA, TimestepNorm, RMSNorm, LayerNorm)


def apply_fsdp(
    model: nn.Module, mesh=None, bf16: bool = False, reshard_after_forward: bool = True
) -> nn.Module:
    """Shard ``model`` (MegalodonLM or MegalodonClassifier) in place over ``mesh`` (default: the world)."""
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else fp32
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    for block in model.layers:
        if bf16:
            for sub in block.modules():
                if isinstance(sub, FLOAT32_MODULES):
                    fully_shard(sub, mp_policy=fp32, **kw)
        fully_shard(block, mp_policy=policy, **kw)
    fully_shard(model, mp_policy=policy, **kw)
    return model


def uses_model_parallel(module) -> bool:
    """True when the Lightning trainer runs ModelParallelStrategy (our ``trainer.strategy=fsdp``)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer = getattr(module, "_trainer", None)
    return trainer is not None and isinstance(trainer.strategy, ModelParallelStrategy)
