"""FSDP2 on CPU over gloo: the gradients of a sharded step are the single-process gradients of the same global
batch, judged against float64 within twice the float32 single process's own error."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from spawn_support import free_port, spawn

from mega_suite.models.megalodon.config import MegalodonConfig

CFG = dict(
    num_layers=2, model_dim=16, num_heads=2, z_dim=8, value_dim=16, ffn_hidden_dim=24, swiglu=True,
    cema_ndim=4, norm_num_groups=4, chunk_size=8, vocab_size=32,
)  # fmt: skip


LLAMA = dict(num_layers=2, model_dim=16, num_heads=2, ffn_hidden_dim=24, vocab_size=32, max_seq_len=32)


def _build(seed: int = 0, arch: str = "megalodon"):
    from mega_suite.models import build_model
    from mega_suite.models.llama import LlamaConfig

    torch.manual_seed(seed)
    if arch == "llama":
        return build_model(LlamaConfig(**LLAMA))
    # megalodon-rebuild: Linear outputs rebuilt in backward from the unsharded weights forward used
    rebuild = "always" if arch == "megalodon-rebuild" else "never"
    return build_model(MegalodonConfig(**CFG, recompute_linears=rebuild))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (4, 21), generator=g)


def _backward(model, tokens, loss_scale: float = 1.0):
    logits, _ = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) * loss_scale
    loss.backward()


def _worker(rank: int, world: int, port: int, out_path: str, arch: str = "megalodon") -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from mega_suite.distributed.fsdp import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = _build(arch=arch)
    apply_fsdp(model)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "apply_fsdp left parameters unsharded"
    tokens = _batch()
    shard = tokens.chunk(world)[rank]
    # FSDP averages gradients over ranks: the per-rank mean loss gives the global mean loss's gradient.
    _backward(model, shard)
    grads = {}
    for name, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), name  # reduce-scattered into this rank's shard
        grads[name] = p.grad.full_tensor().detach().clone()
    if rank == 0:
        torch.save(grads, out_path)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch", ["megalodon", "megalodon-rebuild", "llama"])
def test_fsdp2_gradients_match_single_process(arch):
    """The same FSDP2 code (units and islands asked of the model) shards every registered architecture."""
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "state.pt")
        spawn(_worker, world, world, free_port(), out, arch)
        sharded = torch.load(out, weights_only=True)
    single = _build(arch=arch)
    _backward(single, _batch())
    exact = _build(arch=arch).double()
    _backward(exact, _batch())
    want = dict(exact.named_parameters())
    assert set(sharded) == set(want)
    for name, p in single.named_parameters():
        g64 = want[name].grad
        own = (p.grad.double() - g64).abs().max()  # the float32 single process's own rounding error
        err = (sharded[name].double() - g64).abs().max()
        assert err <= 2 * own + 1e-7 * g64.abs().max(), f"{name}: {err:.3g} vs 2 x {own:.3g}"


# ----------------------------------------------------------------------------------------------------------
# bf16-mixed under FSDP2: the model's one precision declaration, the same residual dtype as on one device
# ----------------------------------------------------------------------------------------------------------


def _bf16_probe(model):
    """Forward hooks: dtype of every block's output (the residual stream) and of the float32 islands'
    parameters as they are used (unsharded, inside the forward)."""
    seen = {"stream": [], "island_params": [], "unit_params": []}
    for block in model.layers:
        block.register_forward_hook(lambda m, i, o: seen["stream"].append(o[0].dtype))
        block.register_forward_pre_hook(lambda m, i: seen["unit_params"].append(m.mega.wz.weight.dtype))
    for island in model.float32_modules():
        island.register_forward_pre_hook(
            lambda m, i: seen["island_params"].extend(p.dtype for p in m.parameters(recurse=False))
        )
    return seen


def _bf16_forward(model, tokens):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(tokens)
    return logits


def _bf16_worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    from mega_suite.distributed.fsdp import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = _build()
    apply_fsdp(model, bf16=True)
    seen = _bf16_probe(model)
    logits = _bf16_forward(model, _batch())
    logits.float().square().mean().backward()
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
    if rank == 0:
        torch.save({"logits": logits.detach(), "grad_dtypes": grad_dtypes, **seen}, out_path)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_fsdp2_bf16_keeps_the_single_device_precision():
    """bf16-mixed under FSDP2 == autocast on one device: float32 residual stream, float32 islands, bf16
    block weights, float32 gradients, and the same logits (the weights autocast rounds are the same)."""
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bf16.pt")
        spawn(_bf16_worker, world, world, free_port(), out)
        sharded = torch.load(out, weights_only=True)
    single = _build()
    seen = _bf16_probe(single)
    logits = _bf16_forward(single, _batch())
    assert set(sharded["stream"]) == set(seen["stream"]) == {torch.float32}
    assert sharded["island_params"] and set(sharded["island_params"]) == {torch.float32}
    assert set(sharded["unit_params"]) == {torch.bfloat16}
    assert sharded["grad_dtypes"] == ["torch.float32"]
    assert sharded["logits"].dtype == logits.dtype == torch.float32
    torch.testing.assert_close(sharded["logits"], logits.detach(), rtol=1e-2, atol=1e-2)
