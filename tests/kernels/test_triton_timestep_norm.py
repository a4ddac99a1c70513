"""Fused Triton TimestepNorm (kernels/timestep_norm/triton.py) against the float64 PyTorch reference
(kernels/timestep_norm/reference.py).

Runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set before Triton is imported) and on
CUDA tensors natively where there is a GPU. The Triton entry point is called directly, since dispatch picks
the reference for CPU tensors. Every buffer the launchers allocate is pre-filled with NaN, so an element no
kernel wrote shows up. GPU-only tests (bf16, L = 32K, D = 4096) are skipped without CUDA.
"""

import os
import types

import torch

if not torch.cuda.is_available():  # before triton is imported: run the kernels under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import oracles  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

from triton_support import DEVICE, INTERPRET, gpu_only, nan_allocations, needs_device  # noqa: E402,F401

from kernels.timestep_norm import reference  # noqa: E402
from kernels.timestep_norm import triton as fused  # noqa: E402

pytestmark = needs_device

TOL = 1e-5  # max |err| / max |ref| for float32 kernels against the float64 reference


def make_case(B, L, D, G, seed, state=False, padding=False, loc=3.0, scale=2.0):
    """float64 tensors with float32-representable values: (x, weight, bias, mean0, var0), count0, mask.
    With padding, row 0 starts with padded steps and, when B > 2, row 2 is all padding (its state must
    pass through unchanged); with a state, row 0 has count 0 (prior ignored), the others a real prior."""
    g = torch.Generator().manual_seed(seed)
    x = loc + scale * torch.randn(B, L, D, generator=g, dtype=torch.float64)
    weight = 0.3 * torch.randn(D, generator=g, dtype=torch.float64)
    bias = 0.3 * torch.randn(D, generator=g, dtype=torch.float64)
    tensors = [x, weight, bias]
    count = None
    if state:
        count = torch.tensor([0] + [5 + 7 * i for i in range(B - 1)], dtype=torch.int64)
        tensors += [
            loc + torch.randn(B, G, generator=g, dtype=torch.float64),
            1 + torch.rand(B, G, generator=g),
        ]
    mask = None
    if padding:
        mask = torch.rand(B, L, generator=g) < 0.3
        mask[0, : min(3, L)] = True
        if B > 2:
            mask[2] = True
    return [t.float().double() for t in tensors], count, mask


def run(module, tensors, count, mask, G, dtype, device, **kwargs):
    """Forward + backward with random cotangents on y, mean and var; returns outputs and input gradients."""
    inputs = [t.to(device=device, dtype=dtype).requires_grad_() for t in tensors]
    x, weight, bias = inputs[:3]
    state = None if count is None else (count.to(device), inputs[3], inputs[4])
    mask = None if mask is None else mask.to(device)
    y, (count_out, mean, var) = module.timestep_norm(x, weight, bias, G, 1e-5, state, mask, **kwargs)
    g = torch.Generator().manual_seed(4321)
    outputs = [y, mean, var]
    cotangents = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(device, o.dtype) for o in outputs]
    grads = torch.autograd.grad(outputs, inputs, cotangents)
    return [o.detach() for o in outputs] + [count_out], list(grads)


CASES = {
    # B, L, D, G, state, padding, block_t
    "L1-state": (2, 1, 8, 4, True, False, None),
    "L7-pad-empty-row": (3, 7, 8, 2, False, True, None),
    "L7-state-pad-empty-row-tiled": (3, 7, 12, 3, True, True, 2),
    "L65-state-pad-tiled": (2, 65, 12, 3, True, True, 16),
    "L65-odd-width": (2, 65, 20, 4, True, False, None),
    "L65-D24-pad": (2, 65, 24, 4, False, True, 32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_match_float64_reference(case):
    B, L, D, G, state, padding, block_t = CASES[case]
    tensors, count, mask = make_case(B, L, D, G, seed=len(case), state=state, padding=padding)
    ref_out, ref_grads = run(reference, tensors, count, mask, G, torch.float64, "cpu")
    with nan_allocations():
        out, grads = run(fused, tensors, count, mask, G, torch.float32, DEVICE, block_t=block_t)
    assert torch.equal(out[3].cpu(), ref_out[3]), "count"
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    names = ["y", "mean", "var", "dx", "dweight", "dbias", "dmean0", "dvar0"]
    for name, a, b in zip(names, out[:3] + grads, ref_out[:3] + ref_grads):
        assert torch.isfinite(a).all(), f"{case}: {name} has non-finite (unwritten) elements"
        err = oracles.max_rel_err(a.cpu(), b)
        assert err <= TOL, f"{case}: {name} relative error {err:.2e}"
    if padding:
        assert (out[0].cpu()[mask] == 0).all() and (grads[0].cpu()[mask] == 0).all()


def test_float32_long_sequence_large_mean():
    """L = 4096, x ~ N(100, 1): float32 kernels vs float64, relative error <= 1e-5 (outputs, state and
    gradients). Plain float32 running sums would cancel catastrophically here."""
    tensors, _, _ = make_case(1, 4096, 8, 2, seed=7, loc=100.0, scale=1.0)
    ref_out, ref_grads = run(reference, tensors, None, None, 2, torch.float64, "cpu")
    out, grads = run(fused, tensors, None, None, 2, torch.float32, DEVICE, block_t=256)
    for name, a, b in zip(
        ["y", "mean", "var", "dx", "dweight", "dbias"], out[:3] + grads, ref_out[:3] + ref_grads
    ):
        err = ((a.cpu().double() - b).norm() / b.norm()).item()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def test_deterministic():
    """Two runs give bitwise-equal outputs and gradients (no atomics; fixed-order partial sums)."""
    tensors, count, mask = make_case(2, 7, 8, 2, seed=3, state=True, padding=True)
    first = run(fused, tensors, count, mask, 2, torch.float32, DEVICE, block_t=4)
    second = run(fused, tensors, count, mask, 2, torch.float32, DEVICE, block_t=4)
    for a, b in zip(first[0] + first[1], second[0] + second[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["L7-state-pad-empty-row-tiled", "L65-odd-width"])
def test_torch_compile_keeps_one_graph(case):
    """The kernels are two custom ops with fake implementations, so torch.compile traces a call whole
    (fullgraph: no graph break) and gives the eager kernels' outputs and gradients. Before, the entry point
    was ``torch.compiler.disable``d: a compiled block on CUDA broke its graph at every TimestepNorm."""
    B, L, D, G, state, padding, block_t = CASES[case]
    tensors, count, mask = make_case(B, L, D, G, seed=9, state=state, padding=padding)
    torch._dynamo.reset()
    compiled = types.SimpleNamespace(
        timestep_norm=torch.compile(fused.timestep_norm, backend="aot_eager", fullgraph=True)
    )
    got = run(compiled, tensors, count, mask, G, torch.float32, DEVICE, block_t=block_t)
    want = run(fused, tensors, count, mask, G, torch.float32, DEVICE, block_t=block_t)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_custom_ops_pass_opcheck():
    """torch.library.opcheck of both ops: the schema, the fake shapes / dtypes / strides (float64 statistics
    included) against the real outputs, and the ops under AOT dispatch."""
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    B, L, D, G = 2, 9, 6, 3
    g = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=g).to(DEVICE) for shape in ((B, L, D), (D,), (D,)))
    mean0, var0 = torch.randn(B, G, generator=g).to(DEVICE), (torch.rand(B, G, generator=g) + 0.5).to(DEVICE)
    count0 = torch.tensor([2, 0], device=DEVICE)
    pad = (torch.rand(B, L, generator=g) < 0.3).to(torch.int8).to(DEVICE)
    fwd_args = (x, weight, bias, mean0, var0, count0, pad, G, 1e-5, 4)
    torch.library.opcheck(torch.ops.mega_suite.timestep_norm_fwd.default, fwd_args, test_utils=tests)
    y, mean, var, mean_f, starts, n_final, shift = torch.ops.mega_suite.timestep_norm_fwd(*fwd_args)
    bwd_args = (
        torch.randn_like(y), torch.randn_like(mean), None, x, pad, weight, count0, mean0, mean_f, starts,
        n_final, shift, G, 1e-5, 4,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.mega_suite.timestep_norm_bwd.default, bwd_args, test_utils=tests)


# ------------------------------------------------------------------------------------------ GPU only


@gpu_only
def test_bf16_error_within_twice_pytorch():
    """bf16 x (float32 statistics): error vs float64 <= 2x the same PyTorch reference's in bf16 + atol."""
    tensors, count, mask = make_case(2, 2048, 256, 8, seed=13, state=True, padding=True)
    ref_out, ref_grads = run(reference, tensors, count, mask, 8, torch.float64, "cpu")

    def go(module):
        x, weight, bias, mean0, var0 = (t.to("cuda", torch.float32).requires_grad_() for t in tensors)
        xb = x.detach().to(torch.bfloat16).requires_grad_()
        y, (_, mean, var) = module.timestep_norm(
            xb, weight, bias, 8, 1e-5, (count.cuda(), mean0, var0), mask.cuda()
        )
        g = torch.Generator().manual_seed(4321)
        outs = [y, mean, var]
        cots = [torch.randn(o.shape, generator=g, dtype=torch.float64).to("cuda", o.dtype) for o in outs]
        return [o.detach() for o in outs] + list(
            torch.autograd.grad(outs, [xb, weight, bias, mean0, var0], cots)
        )

    expected = ref_out[:3] + ref_grads
    err_triton = [oracles.max_rel_err(a.double().cpu(), b) for a, b in zip(go(fused), expected)]
    err_torch = [oracles.max_rel_err(a.double().cpu(), b) for a, b in zip(go(reference), expected)]
    for et, er in zip(err_triton, err_torch):
        assert et <= 2 * er + 1e-5, (err_triton, err_torch)


@gpu_only
def test_large_shape_matches_reference():
    """L = 32K, D = 4096, G = 64, bf16: forward and backward agree with the float32 reference."""
    B, L, D, G = 1, 32768, 4096, 64
    torch.manual_seed(0)
    x = (3 + torch.randn(B, L, D, device="cuda")).to(torch.bfloat16).requires_grad_()
    weight = (0.1 * torch.randn(D, device="cuda")).requires_grad_()
    bias = (0.1 * torch.randn(D, device="cuda")).requires_grad_()
    gy = torch.randn(B, L, D, device="cuda", dtype=torch.bfloat16)
    results = []
    for module in (fused, reference):
        y, (_, mean, var) = module.timestep_norm(x, weight, bias, G)
        grads = torch.autograd.grad([y, mean.sum() + var.sum()], [x, weight, bias], [gy, None])
        results.append([y.float(), mean, var] + [g.float() for g in grads])
    for a, b in zip(*results):
        assert torch.isfinite(a).all()
        assert ((a - b).norm() / b.norm()).item() < 1e-2
