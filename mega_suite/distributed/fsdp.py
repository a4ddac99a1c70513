"""FSDP2 sharding (torchtitan style): ``fully_shard`` per unit the model names, then the root.

The model declares what to shard and what stays float32 (``fsdp_units()``, ``float32_modules()``; see the
precision policy in ``mega_suite.models.common``); nothing here matches parameter names. Under bf16-mixed:

- each unit (block) all-gathers bf16 parameters and reduce-scatters float32 gradients; it does not cast its
  inputs, so the residual stream stays float32 as under autocast on one device or DDP;
- each float32 island inside a unit (CEMA, norms) is its own unit with float32 parameters;
- the root (embedding, final norm, logits head) keeps float32 parameters: the stream enters the blocks in
  float32 and the logits are float32 (docs/architecture.md).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

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
    # The root keeps its parameters gathered from forward to backward (torchtitan's choice; they are needed
    # at once in backward), which also lets its entry points nest (forward calls forward_hidden).
    fully_shard(model, mp_policy=FLOAT32, mesh=mesh, reshard_after_forward=False)
    for method in model.fsdp_forward_methods():
        register_fsdp_forward_method(model, method)
    return model


def uses_model_parallel(module) -> bool:
    """True when the Lightning trainer runs ModelParallelStrategy (our ``trainer.strategy=fsdp``)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    trainer = getattr(module, "_trainer", None)
    return trainer is not None and isinstance(trainer.strategy, ModelParallelStrategy)


# --------------------------------------------------------------------------------------------------------------
# The device mesh
# --------------------------------------------------------------------------------------------------------------

STRATEGIES_THAT_SHARD = ("fsdp", "hsdp")


def mesh_shape(
    world: int, nodes: int, strategy: str, chunk_parallel: int = 1
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, dim names) of the device mesh of ``strategy`` over ``world`` ranks on ``nodes`` nodes.

    - ``fsdp``: one data-parallel dim sharding over every rank of every node: ``("dp_shard",)`` = (world,);
    - ``hsdp``: shard inside a node, replicate across nodes: ``("replicate", "shard")`` = (nodes, world / nodes);
    - ``chunk_parallel`` = c > 1 appends a ``"cp"`` dim of size c (innermost: the ranks of one chunk group are
      neighbours, on one node); the data-parallel dims then cover world / c ranks.

    Every dim except ``"cp"`` is data-parallel: ranks that differ in them see different batches.
    """
    if strategy not in STRATEGIES_THAT_SHARD:
        raise ValueError(f"strategy must be one of {STRATEGIES_THAT_SHARD}, got {strategy!r}")
    if chunk_parallel < 1 or world % chunk_parallel:
        raise ValueError(f"chunk_parallel={chunk_parallel} must divide the world size {world}")
    if nodes < 1 or world % nodes:
        raise ValueError(f"num_nodes={nodes} must divide the world size {world}")
    dp = world // chunk_parallel
    if strategy == "fsdp":
        shape, names = (dp,), ("dp_shard",)
    else:
        per_node = dp // nodes if dp % nodes == 0 else 0
        if per_node == 0:
            raise ValueError(f"hsdp: {dp} data-parallel ranks do not split evenly over {nodes} nodes")
        shape, names = (nodes, per_node), ("replicate", "shard")
    if chunk_parallel > 1:
        shape, names = (*shape, chunk_parallel), (*names, "cp")
    return shape, names


def build_mesh(world: int, nodes: int, strategy: str, chunk_parallel: int = 1, device_type: str = "cpu"):
    """The ``DeviceMesh`` of ``mesh_shape`` (needs an initialised process group of ``world`` ranks).

    ``apply_fsdp`` takes its data-parallel part (``data_parallel_mesh``): a 1-D mesh shards (FSDP), a 2-D
    (replicate, shard) mesh shards along "shard" and replicates along "replicate" (HSDP).
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = mesh_shape(world, nodes, strategy, chunk_parallel)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def data_parallel_mesh(mesh):
    """The dims of ``mesh`` that split the data (all but "cp"), as one (sub-)mesh."""
    names = tuple(n for n in (mesh.mesh_dim_names or ()) if n != "cp")
    if names == tuple(mesh.mesh_dim_names or ()):
        return mesh
    return mesh[names if len(names) > 1 else names[0]]


def data_parallel_rank(mesh) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel ranks of ``mesh`` (row-major over its dims)."""
    dp = data_parallel_mesh(mesh)
    rank, size = 0, 1
    for dim in range(dp.ndim):
        rank = rank * dp.size(dim) + dp.get_local_rank(dim)
        size *= dp.size(dim)
    return rank, size


# --------------------------------------------------------------------------------------------------------------
# Meta -> shard -> materialise -> initialise
# --------------------------------------------------------------------------------------------------------------


def _unit_of(model: nn.Module) -> dict[int, int]:
    """id(module) -> id of the top-level FSDP unit holding it (a block, or the root)."""
    owner = {id(m): id(model) for m in model.modules()}
    for unit in model.fsdp_units():
        for m in unit.modules():
            owner[id(m)] = id(unit)
    return owner


def _local_slice(full: Tensor, param) -> Tensor:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    return full[index]


def materialize(model: nn.Module, device: torch.device | str, init_seed: int | None, sharded: bool) -> None:
    """Allocate a meta-device model (its local shards when ``sharded``) on ``device`` and initialise it from
    ``init_seed`` alone: the caller's global generator is neither read nor advanced (Lightning happens to
    re-seed before ``configure_model``; runs must not depend on that)."""
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[]):
        if init_seed is not None:
            torch.manual_seed(init_seed)
        if sharded:
            init_sharded(model)
        else:
            model.init_weights()


def init_sharded(model: nn.Module) -> None:
    """``model.init_weights()`` on a sharded, materialised (``to_empty``) model, drawing exactly the random
    numbers a single process draws: the full parameters equal those of ``to_empty`` + ``init_weights`` on one
    rank with the same seed, whatever the number of ranks.

    DTensor's random ops are not rank-independent on CPU (``is_rng_supported_mesh`` is False: each rank
    would draw its shard from the same CPU generator state, giving equal shards). So every ``reset_parameters``
    runs on full, plain copies (all-gathered) of the parameters of its subtree that its FSDP unit holds -- at
    most one unit (one block, or the root's embedding / head) is ever whole -- and each rank keeps its slice. Every rank
    draws the same stream (same seed), so the slices are consistent.
    """
    from torch.distributed.tensor import DTensor

    owner = _unit_of(model)
    wrapped = []

    def wrap(module: nn.Module):
        original = module.reset_parameters

        def reset_parameters() -> None:
            held, fulls = [], {}  # fulls: id(DTensor) -> its full copy, once for tied parameters
            for sub in module.modules():
                if owner[id(sub)] != owner[id(module)]:
                    continue
                for name, p in list(sub._parameters.items()):
                    if isinstance(p, DTensor):
                        if id(p) not in fulls:
                            # gathered, not empty: a reset that leaves a parameter alone keeps its values
                            full = nn.Parameter(p.detach().full_tensor(), requires_grad=p.requires_grad)
                            fulls[id(p)] = (p, full)
                        sub._parameters[name] = fulls[id(p)][1]
                        held.append((sub, name, p))
            try:
                original()
            finally:
                with torch.no_grad():
                    for p, full in fulls.values():
                        p.to_local().copy_(_local_slice(full.detach(), p))
                    for sub, name, p in held:
                        sub._parameters[name] = p

        module.reset_parameters = reset_parameters
        wrapped.append(module)

    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            wrap(m)
    try:
        model.init_weights()
    finally:
        for m in wrapped:
            del m.reset_parameters


def resident_parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage this rank holds (its shards; tied parameters once)."""
    seen, total = set(), 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if id(p) not in seen:
            seen.add(id(p))
            total += local.numel() * local.element_size()
    return total
