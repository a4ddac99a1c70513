"""Fused Triton chunk attention (kernels/attention/triton.py) against float64 references.

Runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set before Triton is imported); the
launchers / autograd function are called directly because dispatch picks the reference for CPU tensors.
GPU-only tests (bf16, long sequences) are skipped without CUDA; speed is measured in bench/kernels.py.
"""

import os

import torch

if not torch.cuda.is_available():  # before triton is imported: run the kernels under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from triton_support import DEVICE, INTERPRET, attention_inputs, attention_padding, gpu_only, needs_device  # noqa: E402

import kernels.attention.triton as fused  # noqa: E402
from kernels.attention import reference  # noqa: E402

pytestmark = needs_device

FP32 = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(autouse=True)
def nan_filled_outputs(monkeypatch):
    """Every kernel output starts as NaN, so an element no program writes fails the comparison."""
    monkeypatch.setattr(fused, "DEBUG_NAN_FILL", True)


# On a GPU, fixed tiles unless a test is marked ``autotune``: the autotuner compiles every configuration of
# the four kernels for each new (chunk, widths, causal, padding, dtype) key, 2-5 s each, and these tests
# use dozens of keys (the first H100 run of this file did not finish in 7 minutes). Which tiles are correct
# is what the tests check; the tests marked ``autotune`` run the tuned path that users get.
GPU_TEST_TILES = fused.KernelConfig(block_m=32, block_n=32, block_dv=32, num_warps=4, num_stages=2)


@pytest.fixture(autouse=True)
def fixed_tiles_on_gpu(request):
    if INTERPRET or request.node.get_closest_marker("autotune"):
        yield
        return
    with fused.kernel_config(GPU_TEST_TILES):
        yield


def run_fused(q, k, v, do, C, causal, kpm=None, p=0.0, seed=None):
    """Output and input gradients of the Triton path."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fused.chunk_attention(*leaves, C, causal, kpm, p, seed=seed)
    o.backward(do)
    return o.detach(), *(t.grad for t in leaves)


def run_reference64(fn, q, k, v, do, *args):
    """Output and input gradients of ``fn`` in float64 on the CPU."""
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves, *args)
    o.backward(do.detach().cpu().double())
    return o.detach(), *(t.grad for t in leaves)


def assert_close_all(got, want, **tol):
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert not torch.isnan(a).any(), f"{name} has NaN"
        torch.testing.assert_close(a.double().cpu(), b.cpu(), msg=lambda m, n=name: f"{n}: {m}", **tol)


def dropkey_oracle(q, k, v, C, causal, kpm, dropped):
    """Float64 chunked softmax attention, written out, with the kernels' DropKey decisions applied:
    dropped [B, h, L, c] (query i, key chunk_start(i) + j)."""
    B, L, H, _ = q.shape
    c = min(C, L)
    out = []
    for s in range(0, L, c):
        e = min(s + c, L)
        n = e - s
        logits = torch.einsum("bqhd,bkhd->bhqk", q[:, s:e], k[:, s:e])
        keep = ~dropped[:, :, s:e, :n]
        if causal:
            keep = keep & torch.ones(n, n, dtype=torch.bool).tril()
        if kpm is not None:
            keep = keep & ~kpm[:, None, None, s:e]
        some = keep.any(-1, keepdim=True)
        logits = torch.where(keep, logits, -math.inf)
        probs = torch.where(some, torch.softmax(torch.where(some, logits, 0.0), -1), 0.0)
        out.append(torch.einsum("bhqk,bkhd->bqhd", probs, v[:, s:e]))
    return torch.cat(out, dim=1)


# (L, C, dv, key padding): L in {1, 7, 33}, C in {4, 8, 16}, dv 8 (dV fused into the dK kernel) or 32
# (value width split in two tiles in the forward, dP accumulated over tiles in the backward).
CASES = [
    (1, 4, 8, True),
    (7, 4, 32, True),
    (7, 8, 8, False),
    (7, 16, 32, True),
    (33, 8, 8, True),
    (33, 16, 32, True),
]


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("L,C,dv,padded", CASES)
def test_matches_reference(L, C, dv, padded, causal):
    B, H, dk = 2, 2, 16
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=L * 100 + C)
    kpm = attention_padding(B, L, C, seed=L + C) if padded else None
    got = run_fused(q, k, v, do, C, causal, kpm)
    want = run_reference64(reference.chunk_attention, q, k, v, do, C, causal, kpm)
    assert_close_all(got, want, **FP32)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_multi_block_chunks_and_split_dv(causal):
    """Several query / key blocks per chunk (BLOCK_M != BLOCK_N), a short last chunk, and the backward's
    separate dV kernel (value width wider than the fused limit)."""
    B, H, dk, dv, L, C = 2, 2, 16, 32, 50, 40
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=7)
    kpm = attention_padding(B, L, C, seed=3)
    cfg = fused.KernelConfig(block_m=32, block_n=16, block_dv=16, max_fused_dv=16)
    with fused.kernel_config(cfg):
        got = run_fused(q, k, v, do, C, causal, kpm)
    want = run_reference64(reference.chunk_attention, q, k, v, do, C, causal, kpm)
    assert_close_all(got, want, **FP32)


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["plain", "dropkey"])
def test_one_compiled_chunk_for_many_short_lengths(monkeypatch, p):
    """Length-bucketed classification batches bring a new length almost every step. CHUNK is a compile-time
    constant and an autotune key, so if it followed the length, each step would compile and autotune all
    four kernels again (the first H100 run of lra_listops did not reach step 25 in 4 minutes). A sequence
    shorter than chunk_size runs the kernels compiled for chunk_size, and the results stay exact."""
    chunks = []
    launch = fused._launch

    def spy(tuned, grid_fn, args, meta, tuned_keys):
        chunks.append(meta["CHUNK"])
        launch(tuned, grid_fn, args, meta, tuned_keys)

    monkeypatch.setattr(fused, "_launch", spy)
    B, H, dk, dv, C, seed = 2, 1, 16, 8, 64, 99
    for L in (5, 40, 45, 63):
        q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=L)
        kpm = attention_padding(B, L, C, seed=L)
        got = run_fused(q, k, v, do, C, True, kpm, p, seed)
        dropped = fused.dropkey_mask(seed, B, H, L, C, p, device=DEVICE).cpu()
        want = run_reference64(dropkey_oracle, q, k, v, do, C, True, kpm, dropped)
        assert_close_all(got, want, **FP32)
    assert set(chunks) == {64}, f"kernels compiled for CHUNK {sorted(set(chunks))}; expected one (64)"


def test_strided_inputs_and_broadcast_cotangent():
    """q, k sliced from one packed projection, v stored [B, h, L, dv], and o.sum()'s stride-0 cotangent."""
    B, H, dk, dv, L, C = 2, 2, 16, 8, 11, 8
    q, k, v, _ = attention_inputs(B, L, H, dk, dv, seed=21)
    qk = torch.cat([q, k], dim=-1).requires_grad_()
    v_bhld = v.transpose(1, 2).contiguous().requires_grad_()
    o = fused.chunk_attention(qk[..., :dk], qk[..., dk:], v_bhld.transpose(1, 2), C, True)
    o.sum().backward()
    ones = torch.ones(B, L, H, dv, dtype=torch.float64)
    want = run_reference64(reference.chunk_attention, q, k, v, ones, C, True)
    got = (o.detach(), qk.grad[..., :dk], qk.grad[..., dk:], v_bhld.grad.transpose(1, 2))
    assert_close_all(got, want, **FP32)


def test_fully_masked_rows_are_zero():
    """An all-padding chunk and causal rows whose only key is padding: zero output, zero gradient."""
    B, H, dk, dv, L, C = 2, 2, 16, 8, 12, 4
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=5)
    kpm = torch.zeros(B, L, dtype=torch.bool, device=DEVICE)
    kpm[0, 4:8] = True  # the whole second chunk of batch 0
    kpm[1, ::C] = True  # causal: row 0 of every chunk of batch 1 sees nothing
    o, dq, dk_, dv_ = run_fused(q, k, v, do, C, True, kpm)
    for rows in (o[0, 4:8], dq[0, 4:8], o[1, ::C], dq[1, ::C]):
        assert torch.equal(rows, torch.zeros_like(rows))
    assert torch.equal(dk_[0, 4:8], torch.zeros_like(dk_[0, 4:8]))  # padded keys get no gradient
    assert torch.equal(dv_[0, 4:8], torch.zeros_like(dv_[0, 4:8]))


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_dropkey_matches_oracle(causal):
    B, H, dk, dv, L, C, p, seed = 2, 2, 16, 32, 21, 8, 0.3, 1234
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=11)
    kpm = attention_padding(B, L, C, seed=2)
    got = run_fused(q, k, v, do, C, causal, kpm, p, seed)
    dropped = fused.dropkey_mask(seed, B, H, L, C, p, device=DEVICE).cpu()
    assert 0.15 < dropped.float().mean() < 0.45
    want = run_reference64(dropkey_oracle, q, k, v, do, C, causal, kpm, dropped)
    assert_close_all(got, want, **FP32)


def test_widest_heads_with_dropkey():
    """dk = 256 and dv = 2048 (value width in 8 tiles of 256, dV in its own kernel), causal, DropKey."""
    B, H, dk, dv, L, C, p, seed = 1, 1, 256, 2048, 9, 8, 0.2, 5
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=8)
    q, k = q / 4, k / 4
    with fused.kernel_config(fused.KernelConfig(block_dv=256)):
        got = run_fused(q, k, v, do, C, True, None, p, seed)
    dropped = fused.dropkey_mask(seed, B, H, L, C, p, device=DEVICE).cpu()
    want = run_reference64(dropkey_oracle, q, k, v, do, C, True, None, dropped)
    assert_close_all(got, want, rtol=1e-4, atol=2e-4)


def test_dropkey_mask_depends_on_seed_and_p():
    a = fused.dropkey_mask(1, 2, 1, 6, 4, 0.5, device=DEVICE)
    b = fused.dropkey_mask(2, 2, 1, 6, 4, 0.5, device=DEVICE)
    assert a.shape == (2, 1, 6, 4) and not torch.equal(a, b)
    assert torch.equal(a, fused.dropkey_mask(1, 2, 1, 6, 4, 0.5, device=DEVICE))
    assert not fused.dropkey_mask(1, 2, 1, 6, 4, 0.0, device=DEVICE).any()
    assert (fused.dropkey_mask(1, 2, 1, 6, 4, 0.2, device=DEVICE) <= a).all()  # same uniforms, lower bar


def test_dropkey_p_one_gives_zeros():
    q, k, v, do = attention_inputs(1, 9, 2, 16, 8, seed=4)
    o, dq, dk_, dv_ = run_fused(q, k, v, do, 4, False, None, 1.0, 3)
    for t in (o, dq, dk_, dv_):
        assert torch.equal(t, torch.zeros_like(t))


def test_deterministic():
    q, k, v, do = attention_inputs(2, 13, 2, 16, 32, seed=9)
    kpm = attention_padding(2, 13, 8, seed=9)
    first = run_fused(q, k, v, do, 8, True, kpm, 0.2, 77)
    second = run_fused(q, k, v, do, 8, True, kpm, 0.2, 77)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_float16_within_twice_reference_error():
    """mamba's criterion: |fused - f64| <= 2 |reference in fp16 - f64| + atol."""
    B, H, dk, dv, L, C = 2, 2, 16, 8, 33, 16
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=13)
    q, k, v, do = (0.5 * t for t in (q, k, v, do))
    got = run_fused(*(t.half() for t in (q, k, v, do)), C, True)
    want = run_reference64(reference.chunk_attention, q, k, v, do, C, True)
    half_leaves = [t.half().requires_grad_() for t in (q, k, v)]
    o_ref = reference.chunk_attention(*half_leaves, C, True)
    o_ref.backward(do.half())
    ref16 = (o_ref.detach(), *(t.grad for t in half_leaves))
    for name, a, r, w in zip(("o", "dq", "dk", "dv"), got, ref16, want):
        err, ref_err = (a.double().cpu() - w).abs().max(), (r.double().cpu() - w).abs().max()
        assert err <= 2 * ref_err + 1e-3, f"{name}: {err:.2e} vs reference fp16 error {ref_err:.2e}"


def test_input_errors():
    q = torch.zeros(1, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="head width"):
        fused.chunk_attention(torch.zeros(1, 4, 1, 300), torch.zeros(1, 4, 1, 300), q, 2, True)
    with pytest.raises(ValueError, match="chunk_size"):
        fused.chunk_attention(q, q, q, 0, True)
    with pytest.raises(ValueError, match="expects"):
        fused.chunk_attention(q, q[:, :3], q, 2, True)


@pytest.mark.parametrize("p", [0.0, 0.3], ids=["plain", "dropkey"])
def test_custom_ops_pass_opcheck(p):
    """torch.library.opcheck of both ops: the schema, the fake shapes / dtypes against the real outputs, and
    the ops under AOT dispatch (as torch.compile runs them)."""
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    q, k, v, do = attention_inputs(2, 7, 2, 16, 8, seed=4)
    kpm = attention_padding(2, 7, 4, seed=4)
    seed = torch.tensor([7], dtype=torch.int64, device=DEVICE) if p else None
    fwd_args = (q, k, v, kpm, seed, 4, True, p)
    torch.library.opcheck(torch.ops.mega_suite.chunk_attention_fwd.default, fwd_args, test_utils=tests)
    o, lse = torch.ops.mega_suite.chunk_attention_fwd(*fwd_args)
    bwd_args = (do, q, k, v, o, lse, kpm, seed, 4, True, p)
    torch.library.opcheck(torch.ops.mega_suite.chunk_attention_bwd.default, bwd_args, test_utils=tests)


def test_torch_compile_traces_custom_ops():
    """The custom ops keep dynamo from breaking the graph (aot_eager: no inductor codegen on CPU)."""
    q, k, v, do = attention_inputs(1, 7, 2, 16, 8, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(
        lambda a, b, c: fused.chunk_attention(a, b, c, 4, True), backend="aot_eager", fullgraph=True
    )
    o = compiled(*leaves)
    o.backward(do)
    eager = run_fused(q, k, v, do, 4, True)
    for a, b in zip((o.detach(), *(t.grad for t in leaves)), eager):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------- GPU only


@gpu_only
def test_dispatch_uses_triton_for_cuda(monkeypatch):
    from kernels.attention import chunk_attention

    calls = []
    monkeypatch.setattr(
        fused, "chunk_attention", lambda *a, **kw: calls.append(1) or reference.chunk_attention(*a)
    )
    q = torch.randn(1, 8, 1, 16, device="cuda")
    chunk_attention(q, q, q, 4, True)
    assert calls


@gpu_only
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_large_against_reference(dtype, causal):
    """L=4096, C=1024, dk=128, dv=1024 (split value width): error <= 2 x the reference's in that dtype."""
    B, H, dk, dv, L, C = 1, 2, 128, 1024, 4096, 1024
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=0, dtype=torch.float32, device="cuda")
    q, k = q / dk**0.25, k / dk**0.25
    kpm = attention_padding(B, L, C, seed=0, device="cuda") if B > 1 else None
    want = run_reference64(reference.chunk_attention, q, k, v, do, C, causal, kpm)
    got = run_fused(*(t.to(dtype) for t in (q, k, v, do)), C, causal, kpm)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    o = reference.chunk_attention(*leaves, C, causal, kpm)
    o.backward(do.to(dtype))
    ref_low = (o.detach(), *(t.grad for t in leaves))
    for name, a, r, w in zip(("o", "dq", "dk", "dv"), got, ref_low, want):
        err, ref_err = (a.double().cpu() - w).abs().max().item(), (r.double().cpu() - w).abs().max().item()
        assert err <= 2 * ref_err + 1e-4, f"{name}: {err:.2e} vs reference {dtype} error {ref_err:.2e}"


@gpu_only
@pytest.mark.autotune
def test_gpu_padding_and_dropkey_bf16():
    B, H, dk, dv, L, C, p, seed = 2, 2, 64, 256, 700, 256, 0.1, 5
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=3, device="cuda")
    q, k = q / dk**0.25, k / dk**0.25
    kpm = attention_padding(B, L, C, seed=1, device="cuda")
    got = run_fused(*(t.bfloat16() for t in (q, k, v, do)), C, True, kpm, p, seed)
    dropped = fused.dropkey_mask(seed, B, H, L, C, p, device="cuda").cpu()
    want = run_reference64(dropkey_oracle, q, k, v, do, C, True, kpm, dropped)
    assert_close_all(got, want, rtol=5e-2, atol=5e-2)
