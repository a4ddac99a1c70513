"""The one-row GEMV kernel (kernels/gemv/triton.py) against a float64 oracle: y = W · round(x) + b + a.

Runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, float16 / float32 weights) and on CUDA
natively (bfloat16 and the 7B decode shapes, GPU only). Outputs are allocated NaN-filled, so a row no program
writes shows up. The oracle is written here from the definition, not from kernels/.
"""

import os

import torch

if not torch.cuda.is_available():  # before triton is imported: run the kernels under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from triton_support import DEVICE, gpu_only, nan_allocations, needs_device  # noqa: E402

from kernels.gemv import reference  # noqa: E402
from kernels.gemv import triton as fused  # noqa: E402

pytestmark = needs_device


@pytest.fixture(autouse=True)
def fixed_config_on_gpu(request):
    """On a GPU, one fixed configuration unless a test is marked ``autotune`` (the autotuner compiles and
    times all 13 for each new (O, I) and dtype); the interpreter has one configuration anyway."""
    if os.environ.get("TRITON_INTERPRET") == "1" or request.node.get_closest_marker("autotune"):
        yield
        return
    with fused.fixed_config(block_o=4, block_i=512, num_warps=4):
        yield


def oracle(w, x, bias, add):
    """float64: Σ_i W[o, i] round(x_i) + b_o + a_o, round = the cast of x to W's dtype."""
    y = w.double() @ x.to(w.dtype).double()
    for t in (bias, add):
        if t is not None:
            y = y + t.double()
    return y


def case(o, i, dtype, seed, bias=True, add=True, row_stride=None, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(o, row_stride or i, generator=g)
    w = full[:, :i].to(device=device, dtype=dtype)  # a row stride wider than I when row_stride > i
    x = (3 * torch.randn(i, generator=g)).to(device)  # float32, not representable in float16: rounding shows
    b = torch.randn(o, generator=g).to(device) if bias else None
    a = torch.randn(o, generator=g).to(device) if add else None
    return w, x, b, a


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "o,i,bias,add,stride",
    [(5, 37, True, True, None), (16, 64, False, False, None), (9, 16, True, False, 40), (1, 1, False, True, None),
     (23, 100, True, True, 128)],
)  # fmt: skip
def test_row_gemv_equals_float64_oracle(dtype, o, i, bias, add, stride):
    """Rows and columns not multiples of the blocks (4 x 16 under the interpreter), a row stride wider than
    the input, every bias / addend combination, float16 and float32 weights."""
    w, x, b, a = case(o, i, dtype, seed=o * 100 + i, bias=bias, add=add, row_stride=stride)
    with nan_allocations():
        y = fused.row_gemv(w, x, b, a)
    want = oracle(w, x, b, a)
    assert y.dtype == torch.float32 and y.shape == (o,)
    assert torch.isfinite(y).all()
    scale = (w.double().abs() @ x.to(dtype).double().abs()).max() + 1
    assert float((y.double() - want).abs().max() / scale) < 1e-6


def test_row_gemv_rounds_x_to_the_weight_dtype():
    """With float16 weights the activation is rounded to float16 before the products (as a half-precision
    GEMV reads it): the kernel equals the oracle with the rounding, and differs from the unrounded product."""
    w = torch.ones(4, 16, dtype=torch.float16, device=DEVICE)
    x = torch.full((16,), 1 + 2**-13, device=DEVICE)  # 1 + 2^-13 rounds to 1 in float16
    y = fused.row_gemv(w, x)
    assert torch.equal(y.cpu(), torch.full((4,), 16.0))


def test_row_gemv_rejects_bad_inputs():
    """Each check on its own (a wrong bias length would read past the bias on a GPU)."""
    w, x, b, _ = case(8, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"x must be float32 \[8\]"):
        fused.row_gemv(w, x.half())
    with pytest.raises(ValueError, match="unit column stride"):
        fused.row_gemv(w.t(), x)  # square: only the stride is wrong
    with pytest.raises(ValueError, match=r"x \[I\]"):
        fused.row_gemv(w, x[:3])
    with pytest.raises(ValueError, match=r"bias must be float32 \[8\]"):
        fused.row_gemv(w, x, b[:5])
    with pytest.raises(ValueError, match=r"add must be float32 \[8\]"):
        fused.row_gemv(w, x, None, b.double())
    with pytest.raises(ValueError, match="w must be float16, bfloat16 or float32"):
        fused.row_gemv(w.double(), x)


def test_reference_equals_oracle():
    w, x, b, a = case(7, 33, torch.float16, seed=3, device="cpu")
    torch.testing.assert_close(
        reference.row_gemv(w, x, b, a).double(), oracle(w, x, b, a), rtol=1e-6, atol=1e-5
    )


@pytest.mark.parametrize("bias", [True, False])
def test_custom_op_passes_opcheck(bias):
    """torch.library.opcheck: the schema, the fake output against the real one, and AOT dispatch."""
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    w, x, b, a = case(6, 20, torch.float16, seed=5, bias=bias)
    torch.library.opcheck(torch.ops.mega_suite.row_gemv.default, (w, x, b, a), test_utils=tests)
    torch.library.opcheck(torch.ops.mega_suite.mv.default, (w.float(), x), test_utils=tests)


def test_compiled_call_keeps_the_ops_and_equals_eager():
    """Inside torch.compile (fullgraph) both ops stay single opaque calls in the graph handed to the backend
    (the decomposed graph, as Inductor receives it), and the result equals the eager one."""
    from torch._dynamo.backends.common import aot_autograd

    import kernels.gemv as gemv_ops

    w, x, b, a = case(6, 20, torch.float32, seed=6)

    def f(w, x, b, a):
        return torch.ops.mega_suite.row_gemv(w, x * 2, b, a).relu() + gemv_ops.mv(w, x).sin()

    seen = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend=aot_autograd(fw_compiler=record))(w, x, b, a)
    torch.testing.assert_close(got, f(w, x, b, a), rtol=0, atol=0)
    assert seen.count("mega_suite.row_gemv.default") == 1 and seen.count("mega_suite.mv.default") == 1, seen
    assert not any("aten.mv" in t or "aten.mm" in t for t in seen), seen


@gpu_only
@pytest.mark.autotune
@pytest.mark.parametrize("o,i", [(13312, 4096), (8192, 4096), (4096, 8192), (16384, 4096)])
def test_7b_decode_shapes_bf16(o, i):
    """The 7B decode packs' shapes (m-pack, W_v, W_h2 / fc2, fc1|fc3) in bfloat16 on a GPU."""
    w, x, b, a = case(o, i, torch.bfloat16, seed=o + i, device="cuda")
    y = fused.row_gemv(w, x, b, a)
    want = oracle(w, x, b, a)
    scale = (w.double().abs() @ x.to(torch.bfloat16).double().abs()).max()
    assert float((y.double() - want).abs().max() / scale) < 1e-5
