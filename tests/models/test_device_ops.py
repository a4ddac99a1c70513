"""Device operations of one block's training step (forward + backward), Megalodon beside Llama.

A GPU step costs a launch per operation, whatever its size: at the 7B widths a block's host time and the
many small kernels around TimestepNorm, CEMA and the Q/K path are what keep Megalodon slower than Llama at 4K
(docs/kernels.md#testing). This counts them on the CPU, with no GPU:

- every aten op that reaches the dispatcher and is neither a view / alias nor metadata only (allocation,
  resize): each is a kernel on a GPU. Inside the kernels' custom ops (where a dispatch mode is popped) the
  op's implementation is run under the counter, so their PyTorch glue is counted too;
- every Triton kernel launch, the kernels running in the interpreter on CPU tensors (the dispatch forced to
  them, as on CUDA); what the interpreter does to run a kernel is not counted.

The step is the GPU's bf16-mixed one: autocast on, the float32 islands (TimestepNorm, CEMA, the norms) in
float32, Linears and attention in low precision. The interpreter has no bfloat16, so autocast runs in
float16: the same casts at the same places (autocast's op lists decide where, not the dtype).

Widths are small, structure the 7B's: Megalodon D 64, 4 heads, Z 16, E 128, SwiGLU FFN 128, N 16, chunk 16
over L 32 (two chunks); Llama D 64, 4 heads, SwiGLU FFN 176 (Llama-2-7B's ratio 11008 / 4096). The counts do
not depend on the widths. ``PYTHONPATH=tests/support python tests/models/test_device_ops.py`` prints the breakdown.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
from device_ops import DeviceOps, _setattr, counting_launches

THRESHOLD = 1.25  # issue 29: a Megalodon block in at most 1.25x the device operations of a Llama block
BATCH, LENGTH, DIM = 2, 32, 64

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="counts Triton launches in the interpreter (CPU tensors)",
)


@contextlib.contextmanager
def cuda_paths(block: torch.nn.Module):
    """CPU tensors take the paths CUDA tensors take at the 7B widths: the Triton kernels, attention by
    materialised probabilities, and TimestepNorm called directly (its module recomputes the PyTorch reference
    in backward on CPU only)."""
    import kernels.attention
    import kernels.cema
    import kernels.dispatch
    import kernels.qk_norm_rope
    import kernels.timestep_norm

    with contextlib.ExitStack() as stack:
        # the 7B's attention path (value heads of 2048 > 256): the small widths alone would pick the fused one
        stack.enter_context(_setattr(kernels.attention, "_FORCED_PATH", "probs"))
        for module in (kernels.dispatch, kernels.cema, kernels.timestep_norm, kernels.qk_norm_rope):
            stack.enter_context(_setattr(module, "use_triton", lambda *tensors: True))
        norm = getattr(getattr(block, "mega", None), "timenorm", None)
        if norm is not None:
            owner = sys.modules[type(norm).__module__]
            recompute = owner.recompute

            def direct(fn, *xs):
                if getattr(getattr(fn, "func", None), "__name__", "") == "_flat_norm":
                    return fn(*xs)
                return recompute(fn, *xs)

            stack.enter_context(_setattr(owner, "recompute", direct))
        yield


def megalodon_block() -> torch.nn.Module:
    from mega_suite.models import get_config
    from mega_suite.models.megalodon.block import MegalodonBlock

    seven_b = get_config("megalodon_7b")
    cfg = get_config(
        "megalodon_7b", model_dim=DIM, z_dim=16, value_dim=128, ffn_hidden_dim=128, chunk_size=16,
        norm_num_groups=4, num_layers=1,
        # the 7B's choice at 4K tokens (the small widths alone would choose by other FLOP ratios)
        recompute_linears="always" if seven_b.rebuilds_linears(4096) else "never",
    )  # fmt: skip
    assert cfg.num_heads == 4 and cfg.swiglu and cfg.cema_ndim == 16
    torch.manual_seed(0)
    return MegalodonBlock(cfg).train()


def llama_block() -> torch.nn.Module:
    from mega_suite.models import get_config
    from mega_suite.models.llama.model import LlamaBlock

    cfg = get_config("llama_7b", model_dim=DIM, num_heads=4, ffn_hidden_dim=176, num_layers=1)
    torch.manual_seed(0)
    return LlamaBlock(cfg).train()


def count_step(block: torch.nn.Module, plant=None, warm: bool = False) -> DeviceOps:
    """The device operations of ``block``'s forward under autocast and its backward into the input and every
    parameter, in the second step (the first fills caches, e.g. RoPE's frequencies, as a run's first step
    does; ``warm``: ``block`` has taken that step already). ``plant(out)``, if given, runs on the output inside
    the counted forward (self-checks)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, LENGTH, DIM, generator=gen).requires_grad_()
    cotangent = torch.randn(BATCH, LENGTH, DIM, generator=gen)
    for counter in (DeviceOps(),) if warm else (contextlib.nullcontext(), DeviceOps()):
        counted = counter if isinstance(counter, DeviceOps) else DeviceOps()
        with cuda_paths(block), counting_launches(counted):
            with counter, torch.autocast("cpu", dtype=torch.float16):
                out = block(x)
                out = out[0] if isinstance(out, tuple) else out
                if plant is not None:
                    out = plant(out)
            with counter:
                out.backward(cotangent)
        assert x.grad is not None and torch.isfinite(x.grad).all()
        assert all(p.grad is not None for p in block.parameters())
        block.zero_grad(set_to_none=True)
        x.grad = None
    return counter


def report(meg: DeviceOps, llama: DeviceOps, top: int = 25) -> str:
    lines = [f"Megalodon {meg.total}, Llama {llama.total}: ratio {meg.total / llama.total:.2f}"]
    for title, counter in (("Megalodon", meg), ("Llama", llama)):
        lines.append(f"{title} top ops: " + ", ".join(f"{k} {v}" for k, v in counter.ops.most_common(top)))
        lines.append(f"{title} by source:")
        lines += [f"  {v:4d}  {k}" for k, v in counter.sources.most_common()]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def blocks():
    """One Megalodon and one Llama block, each past its first step (the self-checks count on them)."""
    return megalodon_block(), llama_block()


@pytest.fixture(scope="module")
def counts(blocks):
    meg, llama = count_step(blocks[0]), count_step(blocks[1])
    print("\n" + report(meg, llama))
    return meg, llama


def test_the_counts_are_deterministic(counts, blocks):
    """A fresh block counts what the first did, and so does the first block's next step."""
    meg, llama = counts
    assert count_step(megalodon_block()).ops == meg.ops
    assert count_step(blocks[1], warm=True).ops == llama.ops


def test_every_kernel_of_the_step_is_counted(counts):
    meg, llama = counts
    kernels = {k for k in meg.ops if k.startswith("triton ")}
    for part in ("timestep_norm", "cema", "attention"):  # forward and backward of each
        assert sum(k.startswith(f"triton {part}.") for k in kernels) >= 2, (part, sorted(kernels))
    assert llama.ops["aten.mm"] >= 14, "7 Linears: 7 GEMMs forward, at least 7 backward"


def test_a_planted_op_is_counted_once_and_a_view_not_at_all(counts, blocks, monkeypatch):
    meg, _ = counts
    block = blocks[0]
    assert count_step(block, plant=lambda out: out.clone(), warm=True).total == meg.total + 1
    assert count_step(block, plant=lambda out: out.view(-1).view(out.shape), warm=True).total == meg.total
    # inside a custom op, where a dispatch mode sees nothing unless it runs the implementation itself
    import kernels.timestep_norm.triton as tsn

    forward = tsn._forward

    def planted(x, *args):
        torch.neg(x)
        return forward(x, *args)

    monkeypatch.setattr(tsn, "_forward", planted)
    assert count_step(block, warm=True).total == meg.total + 1


def test_the_threshold_check_fails_on_a_planted_excess(counts, blocks):
    """The check below is live: Llama's own count with ops planted past 1.25x of itself fails it."""
    _, llama = counts
    excess = int(llama.total * (THRESHOLD - 1)) + 1
    planted = count_step(blocks[1], plant=lambda out: _chain(out, excess), warm=True)
    assert planted.total == llama.total + excess
    with pytest.raises(AssertionError):
        check_within(planted, llama)
    check_within(llama, llama)


def _chain(out, n: int):
    for _ in range(n):
        out = out.clone()
    return out


def check_within(meg: DeviceOps, llama: DeviceOps) -> None:
    assert meg.total <= THRESHOLD * llama.total, report(meg, llama)


def test_a_megalodon_block_is_within_125x_the_device_operations_of_a_llama_block(counts):
    """Issue 29's target. Before the fused TimestepNorm scans, CEMA coefficients and Q/K normalisation + RoPE:
    412 against Llama's 146 (2.82x)."""
    check_within(*counts)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    print(report(count_step(megalodon_block()), count_step(llama_block())))
