"""Attention by materialised probabilities (kernels/attention/probs.py), the SDPA-per-chunk path
(kernels/attention/sdpa.py) and the GPU dispatch rules (kernels/attention/__init__.py).

The probs path runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set before Triton is
imported): its GEMMs are torch.bmm on CPU, its two softmax kernels interpreted. Everything is compared with
the float64 per-row oracle of tests/support/oracles.py (``chunk_attention_dropkey``), forward and the gradients of
q, k, v under a random cotangent, with every output and scratch buffer pre-filled with NaN.
"""

import os

import torch

if not torch.cuda.is_available():  # before triton is imported: run the kernels under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import oracles  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

from triton_support import DEVICE, attention_inputs, attention_padding, needs_device  # noqa: E402

import kernels.attention as attention  # noqa: E402
import kernels.attention.probs as probs  # noqa: E402
import kernels.attention.triton as fused  # noqa: E402
from kernels import dispatch  # noqa: E402
from kernels.attention import reference, sdpa  # noqa: E402

FP32 = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(autouse=True)
def nan_filled_buffers(monkeypatch):
    """Every output and scratch buffer (S, P, dP, dS, lse, delta) starts as NaN: an element a kernel or GEMM
    should have written but did not, or one read before it was written, fails the comparison."""
    monkeypatch.setattr(probs, "DEBUG_NAN_FILL", True)
    monkeypatch.setattr(fused, "DEBUG_NAN_FILL", True)


def run_probs(q, k, v, do, C, causal, kpm=None, p=0.0, seed=None, **kw):
    """Output and input gradients of the probs path."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = probs.chunk_attention(*leaves, C, causal, kpm, p, seed, **kw)
    o.backward(do)
    return o.detach(), *(t.grad for t in leaves)


def run_oracle(q, k, v, do, C, causal, kpm=None, dropped=None):
    """Output and input gradients of the float64 oracle (DropKey decisions ``dropped`` [B, h, L, c])."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    kpm = None if kpm is None else kpm.cpu()
    dropped = None if dropped is None else dropped.cpu()
    o = oracles.chunk_attention_dropkey(*leaves, C, causal, kpm, dropped)
    o.backward(do.detach().cpu().double())
    return o.detach(), *(t.grad for t in leaves)


def assert_close_all(got, want, **tol):
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert not torch.isnan(a).any(), f"{name} has NaN"
        torch.testing.assert_close(a.double().cpu(), b.cpu(), msg=lambda m, n=name: f"{n}: {m}", **tol)


# (L, C, padded): L < C (one short chunk, also L = 1), L a multiple of C, ragged last chunks.
CASES = [(1, 4, True), (7, 16, True), (12, 4, False), (7, 4, True), (33, 8, True), (20, 16, False)]


@needs_device
@pytest.mark.parametrize("save", [False, True], ids=["recompute", "saved_p"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("L,C,padded", CASES)
def test_matches_oracle(L, C, padded, causal, save):
    B, H, dk, dv = 2, 2, 16, 32
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=L * 100 + C)
    kpm = attention_padding(B, L, C, seed=L + C) if padded else None
    got = run_probs(q, k, v, do, C, causal, kpm, save_probs=save)
    assert_close_all(got, run_oracle(q, k, v, do, C, causal, kpm), **FP32)


@needs_device
@pytest.mark.parametrize("row_block", [1, 3, 8, 16])
def test_causal_row_blocks(row_block):
    """Causal chunks cut into row blocks (block r multiplies keys up to its own end only), including blocks
    that do not divide the chunk and tiles of the softmax kernels that straddle two blocks."""
    B, H, dk, dv, L, C = 2, 1, 16, 24, 37, 16
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=row_block)
    kpm = attention_padding(B, L, C, seed=row_block)
    blocks = probs.SoftmaxBlocks(fwd_m=4, fwd_n=16, single=True, bwd_m=4, bwd_n=8)
    with probs.block_config(blocks):
        got = run_probs(q, k, v, do, C, True, kpm, row_block=row_block)
    assert_close_all(got, run_oracle(q, k, v, do, C, True, kpm), **FP32)


@needs_device
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize(
    "blocks",
    [
        probs.SoftmaxBlocks(fwd_m=4, fwd_n=16, single=False, bwd_m=8, bwd_n=16),  # rows in several tiles
        probs.SoftmaxBlocks(fwd_m=1, fwd_n=64, single=True, bwd_m=16, bwd_n=64),  # one row per program
    ],
    ids=["two_pass", "one_row"],
)
def test_softmax_tilings(blocks, causal):
    """The forward's two-pass form (rows longer than one tile) and one-row programs, and backward tiles that
    cover a chunk in several pieces, with padding and DropKey."""
    B, H, dk, dv, L, C, p, seed = 2, 2, 16, 32, 50, 40, 0.2, 17
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=3)
    kpm = attention_padding(B, L, C, seed=3)
    with probs.block_config(blocks):
        got = run_probs(q, k, v, do, C, causal, kpm, p, seed, row_block=24)
    dropped = probs.dropkey_mask(seed, B, H, L, C, p, device=DEVICE)
    assert_close_all(got, run_oracle(q, k, v, do, C, causal, kpm, dropped), **FP32)


@needs_device
@pytest.mark.parametrize("save", [False, True], ids=["recompute", "saved_p"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_dropkey_matches_oracle(causal, save):
    B, H, dk, dv, L, C, p, seed = 2, 2, 16, 32, 21, 8, 0.3, 1234
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=11)
    kpm = attention_padding(B, L, C, seed=2)
    got = run_probs(q, k, v, do, C, causal, kpm, p, seed, save_probs=save)
    dropped = probs.dropkey_mask(seed, B, H, L, C, p, device=DEVICE)
    assert 0.15 < dropped.float().mean() < 0.45
    assert_close_all(got, run_oracle(q, k, v, do, C, causal, kpm, dropped), **FP32)


@needs_device
def test_dropkey_stream_is_the_fused_kernels():
    """For one seed both Triton paths drop the same logits: outputs and gradients agree, and differ from
    another seed's."""
    B, H, dk, dv, L, C, p = 2, 2, 16, 32, 19, 8, 0.4
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=6)
    kpm = attention_padding(B, L, C, seed=6)
    mine = run_probs(q, k, v, do, C, True, kpm, p, 99)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fused.chunk_attention(*leaves, C, True, kpm, p, seed=99)
    o.backward(do)
    theirs = (o.detach(), *(t.grad for t in leaves))
    for name, a, b in zip(("o", "dq", "dk", "dv"), mine, theirs):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}", **FP32)
    other = run_probs(q, k, v, do, C, True, kpm, p, 98)
    assert not torch.allclose(other[0], mine[0], **FP32)


@needs_device
def test_fully_masked_rows_are_zero():
    """An all-padding chunk and causal rows whose only key is padding: zero output, zero gradients."""
    B, H, dk, dv, L, C = 2, 2, 16, 8, 12, 4
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=5)
    kpm = torch.zeros(B, L, dtype=torch.bool, device=DEVICE)
    kpm[0, 4:8] = True  # the whole second chunk of batch 0
    kpm[1, ::C] = True  # causal: row 0 of every chunk of batch 1 sees nothing
    o, dq, dk_, dv_ = run_probs(q, k, v, do, C, True, kpm)
    for rows in (o[0, 4:8], dq[0, 4:8], o[1, ::C], dq[1, ::C], dk_[0, 4:8], dv_[0, 4:8]):
        assert torch.equal(rows, torch.zeros_like(rows))


@needs_device
@pytest.mark.parametrize("save", [False, True], ids=["recompute", "saved_p"])
def test_dropkey_p_one_gives_zeros(save):
    q, k, v, do = attention_inputs(1, 9, 2, 16, 8, seed=4)
    for t in run_probs(q, k, v, do, 4, False, None, 1.0, 3, save_probs=save):
        assert torch.equal(t, torch.zeros_like(t))


@needs_device
def test_strided_inputs_and_broadcast_cotangent():
    """q, k sliced from one packed projection (last-dim slices), v stored [B, h, L, dv] (its (B, nc) batch
    does not merge: one GEMM per (batch, head)), and o.sum()'s stride-0 cotangent."""
    B, H, dk, dv, L, C = 2, 2, 16, 8, 16, 8
    q, k, v, _ = attention_inputs(B, L, H, dk, dv, seed=21)
    qk = torch.cat([q, k], dim=-1).requires_grad_()
    v_bhld = v.transpose(1, 2).contiguous().requires_grad_()
    o = probs.chunk_attention(qk[..., :dk], qk[..., dk:], v_bhld.transpose(1, 2), C, True)
    o.sum().backward()
    want = run_oracle(q, k, v, torch.ones(B, L, H, dv), C, True)
    got = (o.detach(), qk.grad[..., :dk], qk.grad[..., dk:], v_bhld.grad.transpose(1, 2))
    assert_close_all(got, want, **FP32)


@needs_device
@pytest.mark.parametrize("save", [False, True], ids=["recompute", "saved_p"])
def test_chunk_groups(monkeypatch, save):
    """A scratch budget below one chunk's logits: the chunks run one group at a time (the kernels offset by
    the group's first chunk for positions, DropKey and lse), padding, DropKey and a ragged last chunk."""
    monkeypatch.setattr(probs, "SCRATCH_LOGITS", 2 * 2 * 8 * 8 * 2)  # two chunks of B 2, h 2, c 8
    assert probs._chunk_groups(2, 2, 5, 8) == [(0, 2), (2, 4), (4, 5)]
    B, H, dk, dv, L, C, p, seed = 2, 2, 16, 32, 37, 8, 0.25, 31
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=12)
    kpm = attention_padding(B, L, C, seed=12)
    got = run_probs(q, k, v, do, C, True, kpm, p, seed, save_probs=save, row_block=3)
    dropped = probs.dropkey_mask(seed, B, H, L, C, p, device=DEVICE)
    assert_close_all(got, run_oracle(q, k, v, do, C, True, kpm, dropped), **FP32)


def test_batch_views_are_views():
    """The GEMM batches are views of the inputs (no copies), as few as the strides allow: all of (B, nc, h)
    in one batch where they merge (one head, or one chunk of one sequence), else for [B, L, h, d] storage one
    batch per head or per (sequence, chunk) whichever is fewer, one per (batch, head) for [B, h, L, d]."""
    B, nc, c, H, d = 2, 3, 4, 2, 5
    blhd = torch.randn(B, nc * c, H, d)
    one_head = torch.randn(B, nc * c, 1, d)
    one_chunk = torch.randn(1, c, 4, d)  # the 7B at 4K: one sequence of one chunk, heads merge
    many_heads = torch.randn(B, c, 4, d)  # one chunk, four heads: two (sequence, chunk) batches
    bhld = torch.randn(B, H, nc * c, d).transpose(1, 2)
    cases = ((one_head, nc, 1), (one_chunk, 1, 1), (blhd, nc, H), (many_heads, 1, B), (bhld, nc, B * H))
    for t, chunks, batches in cases:
        t5 = probs._split(t, chunks, c)
        views = probs._batch_views(t5, t5.transpose(-1, -2))
        assert len(views) == batches
        for a, b in views:
            assert a.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            assert b.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        got = torch.cat([a.reshape(-1) for a, _ in views]).sort().values
        assert torch.equal(got, t.reshape(-1).sort().values)  # every element once


def test_row_blocks_and_gemm_sizes(monkeypatch):
    """Causal: row blocks of ``row_block`` queries, each multiplying keys up to its own end; bidirectional:
    one square. The forward's QKᵀ GEMMs compute exactly sum over blocks of rows x end logits."""
    assert probs._row_blocks(10, 4, True) == [(0, 4), (4, 8), (8, 10)]
    assert probs._row_blocks(10, 4, False) == [(0, 10)]
    assert probs.default_row_block(512, True) == 512
    assert probs.default_row_block(4096, False) == 4096
    assert probs.default_row_block(4096, True) == 1024
    assert probs.default_row_block(3000, True) == 768  # 750 rounded up to 128 rows
    logits = []
    matmul = probs._matmul

    def spy(a, b, out):
        if out.dtype == torch.float32 and a.shape[-1] == 16:  # the QKᵀ products (dk 16, float32 out)
            logits.append(out.shape[-2] * out.shape[-1])
        matmul(a, b, out)

    monkeypatch.setattr(probs, "_matmul", spy)
    q, k, v, _ = attention_inputs(1, 10, 1, 16, 8, seed=0)
    with torch.no_grad():
        probs.chunk_attention(q, k, v, 10, True, row_block=4)
    assert logits == [4 * 4, 4 * 8, 2 * 10]


@needs_device
def test_float16_within_twice_torch_error():
    """|probs fp16 - f64| <= 2 |the same computation in plain PyTorch fp16 - f64| + atol, forward and
    gradients, causal with padding (the plain code: masked logits, softmax, P V, autograd, all in fp16)."""
    B, H, dk, dv, L, C = 2, 2, 16, 32, 33, 16
    q, k, v, do = attention_inputs(B, L, H, dk, dv, seed=13)
    q, k, v, do = (0.5 * t for t in (q, k, v, do))
    kpm = attention_padding(B, L, C, seed=13)
    want = run_oracle(q, k, v, do, C, True, kpm)
    got = run_probs(*(t.half() for t in (q, k, v, do)), C, True, kpm)
    leaves = [t.half().requires_grad_() for t in (q, k, v)]
    o = torch_attention(*leaves, C, True, kpm)
    o.backward(do.half())
    plain = (o.detach(), *(t.grad for t in leaves))
    for name, a, r, w in zip(("o", "dq", "dk", "dv"), got, plain, want):
        err, ref_err = (a.double().cpu() - w).abs().max(), (r.double().cpu() - w).abs().max()
        assert err <= 2 * ref_err + 1e-4, f"{name}: {err:.2e} vs plain fp16 error {ref_err:.2e}"


def torch_attention(q, k, v, C, causal, kpm=None):
    """Chunked attention in plain PyTorch in the inputs' dtype (the low-precision yardstick): per chunk,
    logits, masks, softmax, probabilities times values; empty rows give zeros."""
    L = q.shape[1]
    out = []
    for s in range(0, L, C):
        e = min(s + C, L)
        logits = torch.einsum("bqhd,bkhd->bhqk", q[:, s:e], k[:, s:e])
        keep = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device)
        keep = keep.tril() if causal else keep
        if kpm is not None:
            keep = keep & ~kpm[:, None, None, s:e]
        some = keep.any(-1, keepdim=True)
        probs_ = torch.softmax(logits.masked_fill(~keep, -math.inf).masked_fill(~some, 0.0), -1)
        out.append(torch.einsum("bhqk,bkhd->bqhd", probs_.masked_fill(~some, 0.0), v[:, s:e]))
    return torch.cat(out, dim=1)


@needs_device
@pytest.mark.parametrize("save", [False, True], ids=["recompute", "saved_p"])
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["plain", "dropkey"])
def test_custom_ops_pass_opcheck(p, save):
    """torch.library.opcheck of both ops: the schema, the fake shapes / dtypes against the real outputs, and
    the ops under AOT dispatch (as torch.compile runs them)."""
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    q, k, v, do = attention_inputs(2, 8, 2, 16, 8, seed=4)
    kpm = attention_padding(2, 8, 4, seed=4)
    seed = torch.tensor([7], dtype=torch.int64, device=DEVICE) if p else None
    fwd_args = (q, k, v, kpm, seed, 4, True, p, 8, 2, save)
    torch.library.opcheck(torch.ops.mega_suite.probs_attention_fwd.default, fwd_args, test_utils=tests)
    o, lse, saved = torch.ops.mega_suite.probs_attention_fwd(*fwd_args)
    bwd_args = (do, q, k, v, o, lse, saved, kpm, seed, 4, True, p, 8, 2)
    torch.library.opcheck(torch.ops.mega_suite.probs_attention_bwd.default, bwd_args, test_utils=tests)


@needs_device
def test_torch_compile_traces_custom_ops():
    """The custom ops keep dynamo from breaking the graph (aot_eager: no inductor codegen on CPU); a ragged
    length puts the padding and the slice inside the graph too."""
    q, k, v, do = attention_inputs(1, 7, 2, 16, 8, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(
        lambda a, b, c: probs.chunk_attention(a, b, c, 4, True), backend="aot_eager", fullgraph=True
    )
    o = compiled(*leaves)
    o.backward(do)
    eager = run_probs(q, k, v, do, 4, True)
    for a, b in zip((o.detach(), *(t.grad for t in leaves)), eager):
        torch.testing.assert_close(a, b)


def test_input_errors():
    q = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="chunk_size"):
        probs.chunk_attention(q, q, q, 0, True)
    with pytest.raises(ValueError, match="expects"):
        probs.chunk_attention(q, q[:, :3], q, 2, True)
    with pytest.raises(ValueError, match="one dtype"):
        probs.chunk_attention(q, q.double(), q, 2, True)
    with pytest.raises(ValueError, match="dropout_p"):
        probs.chunk_attention(q, q, q, 2, True, dropout_p=1.5)
    with pytest.raises(ValueError, match="key_padding_mask"):
        probs.chunk_attention(q, q, q, 2, True, torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="row_block"):
        probs.chunk_attention(q, q, q, 2, True, row_block=0)


# ------------------------------------------------------------------------------------------------ SDPA path


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("L,C", [(12, 4), (13, 4), (3, 8), (1, 1)])
def test_sdpa_path_matches_oracle(L, C, causal):
    """SDPA per chunk (chunks folded into the batch, a ragged last chunk as a second call), float64 on CPU."""
    B, H, d = 2, 2, 8
    q, k, v, do = attention_inputs(B, L, H, d, d, seed=L + C, dtype=torch.float64, device="cpu")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = sdpa.chunk_attention(*leaves, C, causal)
    o.backward(do)
    got = (o.detach(), *(t.grad for t in leaves))
    assert_close_all(got, run_oracle(q, k, v, do, C, causal), rtol=1e-9, atol=1e-9)


def test_sdpa_path_input_errors():
    q = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match="one shape"):
        sdpa.chunk_attention(q, q, torch.zeros(1, 4, 1, 16), 2, True)
    with pytest.raises(ValueError, match="chunk_size"):
        sdpa.chunk_attention(q, q, q, 0, True)


# ------------------------------------------------------------------------------------------------ dispatch


def _qkv(dk, dv, dtype=torch.bfloat16):
    return (
        torch.zeros(1, 4, 2, dk, dtype=dtype),
        torch.zeros(1, 4, 2, dk, dtype=dtype),
        torch.zeros(1, 4, 2, dv, dtype=dtype),
    )


@pytest.fixture
def no_forced_path(monkeypatch):
    monkeypatch.delenv("MEGA_SUITE_ATTENTION", raising=False)
    monkeypatch.setattr(attention, "_FORCED_PATH", None)


def test_dispatch_rules(no_forced_path):
    """On a GPU: dv > 256 -> probs; dv <= 256 with dk == dv, no padding, no DropKey -> SDPA; otherwise the
    fused kernel (probs where its dk limit is passed). Off the GPU, or in float64: the reference."""
    pad = torch.zeros(1, 4, dtype=torch.bool)
    path = lambda dk, dv, kpm=None, p=0.0, dtype=torch.bfloat16, on_gpu=True: attention.attention_path(
        *_qkv(dk, dv, dtype), kpm, p, on_gpu=on_gpu
    )
    assert path(256, 2048) == "probs"  # the 7B widths
    assert path(256, 2048, pad, 0.1) == "probs"
    assert path(128, 257) == "probs"
    assert path(256, 256) == "sdpa"
    assert path(64, 64, dtype=torch.float32) == "sdpa"
    assert path(128, 128, pad) == "fused"
    assert path(128, 128, None, 0.1) == "fused"
    assert path(64, 128) == "fused"  # unequal widths: no SDPA fused kernel
    assert path(512, 128) == "probs"  # past the fused kernel's dk limit
    assert path(256, 2048, on_gpu=False) == "reference"
    assert path(16, 16, dtype=torch.float64) == "reference"
    q, k, v = _qkv(16, 16)  # CPU tensors, on_gpu from kernels.dispatch: the reference
    assert attention.attention_path(q, k, v) == "reference"


def test_dispatch_forced_path(no_forced_path, monkeypatch):
    pad = torch.zeros(1, 4, dtype=torch.bool)
    q, k, v = _qkv(256, 256)
    assert attention.attention_path(q, k, v, path="probs", on_gpu=True) == "probs"
    assert attention.attention_path(q, k, v, path="fused", on_gpu=True) == "fused"
    assert attention.attention_path(q, k, v, path="fused", on_gpu=False) == "reference"
    monkeypatch.setenv("MEGA_SUITE_ATTENTION", "fused")
    assert attention.attention_path(q, k, v, on_gpu=True) == "fused"
    attention.force_path("probs")  # the function wins over the environment, the argument over both
    assert attention.attention_path(q, k, v, on_gpu=True) == "probs"
    assert attention.attention_path(q, k, v, path="sdpa", on_gpu=True) == "sdpa"
    attention.force_path(None)
    monkeypatch.setenv("MEGA_SUITE_ATTENTION", "auto")
    assert attention.attention_path(q, k, v, on_gpu=True) == "sdpa"
    with pytest.raises(ValueError, match="sdpa"):
        attention.attention_path(q, k, v, pad, path="sdpa", on_gpu=True)
    with pytest.raises(ValueError, match="dk <= 256"):
        attention.attention_path(*_qkv(512, 512), path="fused", on_gpu=True)
    with pytest.raises(ValueError, match="one of"):
        attention.force_path("flash")
    monkeypatch.setenv("MEGA_SUITE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="MEGA_SUITE_ATTENTION"):
        attention.attention_path(q, k, v, on_gpu=True)


def test_chunk_attention_runs_the_chosen_path(no_forced_path, monkeypatch):
    """chunk_attention calls the implementation attention_path names (Triton 'available' for CPU tensors
    here, each implementation replaced by a recorder)."""
    calls = []
    monkeypatch.setattr(dispatch, "use_triton", lambda *ts: True)
    for name, module in (("probs", probs), ("sdpa", sdpa), ("fused", fused), ("reference", reference)):
        monkeypatch.setattr(module, "chunk_attention", lambda *a, n=name, **kw: calls.append(n))
    pad = torch.zeros(1, 4, dtype=torch.bool)
    attention.chunk_attention(*_qkv(256, 2048), 4, True)
    attention.chunk_attention(*_qkv(128, 128), 4, True)
    attention.chunk_attention(*_qkv(128, 128), 4, True, pad)
    attention.chunk_attention(*_qkv(128, 128, torch.float64), 4, True)
    attention.chunk_attention(*_qkv(128, 128), 4, True, path="probs")
    assert calls == ["probs", "sdpa", "fused", "reference", "probs"]


# ------------------------------------------------------------------------------------------------ bench


def test_bench_flop_arithmetic():
    """bench/attention_gpu.py's FLOP counts against pairs counted one by one: minimal = the (query, key)
    pairs a chunk needs, 2 FLOPs per multiply-add, forward QKᵀ + PV, backward four products (3x forward);
    executed by the probs path = the row blocks' rectangles, plus the recomputed QKᵀ."""
    from bench.attention_gpu import executed_probs_flops, minimal_flops

    B, H, L, C, dk, dv = 2, 3, 11, 4, 5, 7
    for causal in (False, True):
        pairs = sum(1 for i in range(L) for j in range(L) if i // C == j // C and (j <= i or not causal))
        assert minimal_flops(B, H, L, C, dk, dv, causal) == 2 * B * H * pairs * 3 * (dk + dv)
    # C = L = 10, row blocks of 4: rectangles 4x4, 4x8, 2x10 = 68 logits of the 100.
    fwd = 2 * 68 * (dk + dv)
    bwd = 2 * 68 * (dk + 2 * dv + 2 * dk)
    assert executed_probs_flops(1, 1, 10, 10, dk, dv, True, 4) == fwd + bwd
    assert executed_probs_flops(1, 1, 10, 10, dk, dv, False, 4) == 2 * 100 * (4 * dk + 3 * dv)
