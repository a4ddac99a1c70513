"""The Triton TimestepNorm's scans over tiles (kernels/timestep_norm/triton.py) against float64 oracles
written from the math (tests/support/oracles.py): forward, backward, padding, carried state, long sequences with a
large mean, float32 and float16.

Block sizes are forced small (a few groups per tile, several scan blocks, several tiles per backward-sums
program, several dweight / dbias programs) so that every carry and mask of the kernels is exercised at
shapes the interpreter runs quickly. Every buffer the launchers allocate is NaN-filled and guarded: an
element no kernel wrote shows up, and so does a write past either end.
"""

import contextlib
import os

import torch

if not torch.cuda.is_available():  # before triton is imported: run the kernels under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import oracles  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

from triton_support import DEVICE, needs_device  # noqa: E402

from kernels.timestep_norm import reference  # noqa: E402
from kernels.timestep_norm import triton as fused  # noqa: E402

pytestmark = needs_device

TOL = 1e-5  # max |err| / max |ref| of float32 kernels against float64


@contextlib.contextmanager
def guarded_allocations(guard: int = 64):
    """torch.empty / empty_like return NaN-filled (integers: -7) views into the middle of larger buffers;
    on exit, the guard elements on both sides must be untouched (the interpreter copies a kernel's whole
    storage to and from the host, so a write out of bounds lands there)."""
    empty, empty_like = torch.empty, torch.empty_like
    buffers = []

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    def guarded(shape, dtype, device):
        numel = 1
        for n in shape:
            numel *= n
        buf = fill(empty(numel + 2 * guard, dtype=dtype, device=device))
        buffers.append((buf, numel))
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * max(shape[i + 1], 1)
        return buf.as_strided(tuple(shape), tuple(strides), guard)

    def new_empty(*size, dtype=None, device=None, **_):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        return guarded(shape, dtype or torch.get_default_dtype(), device or "cpu")

    def new_empty_like(t, *, dtype=None, device=None, **_):
        return guarded(tuple(t.shape), dtype or t.dtype, device or t.device)

    torch.empty, torch.empty_like = new_empty, new_empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like
    for buf, numel in buffers:
        for side in (buf[:guard], buf[guard + numel :]):
            untouched = side.isnan() if buf.is_floating_point() else side == -7
            assert untouched.all(), f"a kernel wrote out of bounds of a {buf.dtype} buffer of {numel}"


def force_blocks(
    monkeypatch, groups_per_tile=None, scan_block=None, tiles_per_program=None, reduce_block=None
):
    """Smaller blocks than the launchers would pick (None: theirs)."""
    if groups_per_tile is not None:
        config = fused._config
        monkeypatch.setattr(
            fused, "_config", lambda *a: (lambda bt, gb, bf, w: (bt, groups_per_tile, bf, w))(*config(*a))
        )
    if scan_block is not None:
        monkeypatch.setattr(fused, "_scan_config", lambda tiles: scan_block)
    if tiles_per_program is not None:
        monkeypatch.setattr(
            fused, "_tiles_per_program", lambda tiles, programs: min(tiles_per_program, tiles)
        )
    if reduce_block is not None:
        monkeypatch.setattr(fused, "_reduce_block", lambda d: (reduce_block, 2))  # 2 partial rows per step


def make(B, L, D, G, seed, loc=2.0, state=False, padding=False):
    """float64 leaves with float32-representable values (x, weight, bias[, mean0, var0]), count0, mask.
    Padding: row 0 starts with padded steps, row 1 (when B > 2) is all padding, the rest random. State: row 0
    has count 0 (its prior is ignored), the others a real prior with an even count (``virtual_prefix``)."""
    g = torch.Generator().manual_seed(seed)
    x = loc + torch.randn(B, L, D, generator=g, dtype=torch.float64) * torch.linspace(0.5, 2.0, D).double()
    weight = 0.3 * torch.randn(D, generator=g, dtype=torch.float64)
    bias = 0.3 * torch.randn(D, generator=g, dtype=torch.float64)
    leaves = [x, weight, bias]
    count = None
    if state:
        count = torch.tensor([0] + [4 + 6 * i for i in range(B - 1)], dtype=torch.int64)
        leaves += [
            loc + torch.randn(B, G, generator=g, dtype=torch.float64),
            0.5 + torch.rand(B, G, generator=g),
        ]
    mask = None
    if padding:
        mask = torch.rand(B, L, generator=g) < 0.3
        mask[0, : min(3, L)] = True
        if B > 2:
            mask[1] = True
    return [t.float().double() for t in leaves], count, mask


def oracle(leaves, count, mask, G):
    """The brute-force oracle; a carried state acts as synthetic earlier steps with its statistics."""
    x, weight, bias = leaves[:3]
    if count is None:
        return oracles.timestep_norm(x, weight, bias, G, padding_mask=mask)
    prefix, prefix_mask = oracles.virtual_prefix(count, leaves[3], leaves[4], x.shape[2] // G)
    mask = torch.zeros(x.shape[:2], dtype=torch.bool) if mask is None else mask
    y, state = oracles.timestep_norm(
        torch.cat([prefix, x], 1), weight, bias, G, padding_mask=torch.cat([prefix_mask, mask], 1)
    )
    return y[:, prefix.shape[1] :], state


def vjp(fn, leaves, seed=4321):
    """Outputs (y, count, mean, var) and the gradients of random cotangents on y, mean and var."""
    leaves = [t.clone().requires_grad_() for t in leaves]
    y, (count, mean, var) = fn(*leaves)
    g = torch.Generator().manual_seed(seed)
    outs = [y, mean, var]
    cots = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, leaves, cots)
    return [y.detach(), count, mean.detach(), var.detach()], list(grads)


def run_fused(leaves, count, mask, G, dtype=torch.float32, block_t=None):
    def fn(x, weight, bias, *prior):
        state = None if count is None else (count.to(DEVICE), *prior)
        m = None if mask is None else mask.to(DEVICE)
        return fused.timestep_norm(x, weight, bias, G, 1e-5, state, m, block_t=block_t)

    return vjp(fn, [t.to(DEVICE, dtype) for t in leaves])


def run_oracle(leaves, count, mask, G):
    return vjp(lambda *ls: oracle(ls, count, mask, G), leaves)


def assert_matches(got, want, tol=TOL, where=""):
    (out, grads), (out_ref, grads_ref) = got, want
    assert out[1].dtype == torch.int64 and torch.equal(out[1].cpu(), out_ref[1]), (where, out[1], out_ref[1])
    names = ["y", "mean", "var", "dx", "dweight", "dbias", "dmean0", "dvar0"]
    for name, a, b in zip(
        names, [out[0], out[2], out[3]] + grads, [out_ref[0], out_ref[2], out_ref[3]] + grads_ref
    ):
        assert torch.isfinite(a).all(), f"{where}: {name} has non-finite (unwritten) elements"
        err = oracles.max_rel_err(a.cpu(), b)
        assert err <= tol, f"{where}: {name} relative error {err:.2e}"


CASES = {
    # B, L, D, G, state, padding, block_t, forced (groups per tile, scan block, tiles per program, reduce block)
    "one-step-state": (2, 1, 8, 4, True, False, None, (None, None, None, None)),
    "groups-masked-in-last-block": (3, 13, 12, 3, True, True, 4, (2, None, None, None)),
    "many-scan-blocks": (2, 37, 8, 2, True, True, 2, (None, 4, None, None)),
    "ragged-tiles-per-program": (3, 27, 12, 3, False, True, 2, (2, 2, 3, 8)),
    "odd-group-width": (2, 21, 20, 4, True, False, 4, (4, 2, 2, 4)),
    "one-tile": (2, 16, 16, 2, False, False, 16, (None, None, None, None)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_match_float64_oracle(case, monkeypatch):
    B, L, D, G, state, padding, block_t, forced = CASES[case]
    force_blocks(monkeypatch, *forced)
    leaves, count, mask = make(B, L, D, G, seed=len(case), state=state, padding=padding)
    want = run_oracle(leaves, count, mask, G)
    with guarded_allocations():
        got = run_fused(leaves, count, mask, G, block_t=block_t)
    assert_matches(got, want, where=case)
    if padding:
        assert (got[0][0].cpu()[mask] == 0).all() and (got[1][0].cpu()[mask] == 0).all()


def test_padding_only_segments_hand_the_state_through(monkeypatch):
    """A row that is all padding outputs 0, and keeps its incoming state exactly; without a state it gets
    (0, 0, 1). The gradients of its state pass through unchanged."""
    B, L, D, G = 3, 9, 8, 2
    force_blocks(monkeypatch, scan_block=2)
    leaves, count, _ = make(B, L, D, G, seed=5, state=True)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1:] = True
    out, grads = run_fused(leaves, count, mask, G, block_t=2)
    out, grads = [t.cpu() for t in out], [t.cpu() for t in grads]
    assert (out[0][1:] == 0).all()
    assert torch.equal(out[1][1:], count[1:])
    assert torch.equal(out[2][1:], leaves[3][1:].float()) and torch.equal(out[3][1:], leaves[4][1:].float())
    g = torch.Generator().manual_seed(4321)
    _, cot_mean, cot_var = (
        torch.randn(s, generator=g, dtype=torch.float64) for s in ((B, L, D), (B, G), (B, G))
    )
    torch.testing.assert_close(grads[3][1:].double(), cot_mean[1:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[4][1:].double(), cot_var[1:], rtol=1e-6, atol=1e-6)
    y, (count_none, mean, var) = fused.timestep_norm(*(t.float().to(DEVICE) for t in leaves[:3]), G,
                                                     padding_mask=torch.ones(B, L, dtype=torch.bool, device=DEVICE))  # fmt: skip
    assert (y == 0).all() and (count_none == 0).all() and (mean == 0).all() and (var == 1).all()


def test_a_chain_of_segments_equals_one_pass():
    """The Triton state out of one segment, fed into the next, gives the one-pass outputs and state."""
    B, L, D, G = 3, 30, 8, 2
    leaves, _, mask = make(B, L, D, G, seed=11, padding=True)
    x, weight, bias = (t.float().to(DEVICE) for t in leaves)
    mask = mask.to(DEVICE)
    y_one, s_one = fused.timestep_norm(x, weight, bias, G, padding_mask=mask, block_t=4)
    state, ys = None, []
    for start, end in ((0, 1), (1, 7), (7, 19), (19, 30)):
        y, state = fused.timestep_norm(
            x[:, start:end], weight, bias, G, state=state, padding_mask=mask[:, start:end], block_t=4
        )
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, 1), y_one, rtol=1e-5, atol=1e-5)
    assert torch.equal(state[0], s_one[0])
    torch.testing.assert_close(state[1], s_one[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state[2], s_one[2], rtol=1e-5, atol=1e-6)


def test_a_count_beyond_float32_integers_stays_exact():
    """The count is int64 end to end: 2^25 + 1 carried steps plus this segment's valid ones."""
    B, L, D, G = 2, 5, 4, 2
    x = torch.randn(B, L, D, device=DEVICE)
    count0 = torch.tensor([2**25 + 1, 3], device=DEVICE)
    mask = torch.tensor([[False, True, False, False, True], [False] * 5], device=DEVICE)
    _, (count, _, _) = fused.timestep_norm(
        x,
        torch.zeros(D, device=DEVICE),
        torch.zeros(D, device=DEVICE),
        G,
        state=(count0, torch.zeros(B, G, device=DEVICE), torch.ones(B, G, device=DEVICE)),
        padding_mask=mask,
    )
    assert torch.equal(count.cpu(), torch.tensor([2**25 + 4, 8]))


def _long_oracle(x, weight, bias, G):
    """y from the vectorised float64 oracle, the final state from all elements at once (float64)."""
    y = oracles.timestep_norm_cumulative(x, weight, bias, G)
    xg = x.reshape(x.shape[0], -1, G, x.shape[2] // G).transpose(1, 2).reshape(x.shape[0], G, -1)
    var, mean = torch.var_mean(xg, dim=-1, unbiased=False)
    return y, (torch.full((x.shape[0],), x.shape[1]), mean, var)


@pytest.mark.parametrize("drift", [0.0, 50.0])
def test_float32_long_sequence_with_a_large_mean(drift, monkeypatch):
    """L = 2048 in tiles of 8 steps (256 tiles, merged in blocks of 32), x ~ N(100, 1) plus a drift of the
    mean over the sequence: the float32 kernels against float64, relative error <= 2e-6 for the outputs,
    state and gradients. Plain float32 running sums, or the merged mean without its low part, fail here."""
    force_blocks(monkeypatch, scan_block=32)
    B, L, D, G = 1, 2048, 8, 2
    g = torch.Generator().manual_seed(7)
    x = (
        100
        + drift * torch.linspace(0, 1, L).double()[None, :, None]
        + torch.randn(B, L, D, generator=g).double()
    )
    weight, bias = 0.3 * torch.randn(2, D, generator=g).double()
    leaves = [x.float().double(), weight.float().double(), bias.float().double()]
    got = run_fused(leaves, None, None, G, block_t=8)
    want = vjp(lambda *ls: _long_oracle(*ls, G), leaves)
    names = ["y", "mean", "var", "dx", "dweight", "dbias"]
    (out, grads), (out_ref, grads_ref) = got, want
    for name, a, b in zip(
        names, [out[0], out[2], out[3]] + grads, [out_ref[0], out_ref[2], out_ref[3]] + grads_ref
    ):
        err = ((a.cpu().double() - b).norm() / b.norm()).item()
        assert err <= 2e-6, f"{name}: relative error {err:.2e}"


def test_float32_large_carried_state_and_mean():
    """A carried state of a million steps at mean 1000 and a segment near it: the float32 kernels against
    the float64 reference (the same math, float64 throughout)."""
    B, L, D, G = 2, 64, 8, 2
    g = torch.Generator().manual_seed(8)
    x = (1000 + torch.randn(B, L, D, generator=g)).double()
    weight, bias = 0.3 * torch.randn(2, D, generator=g).double()
    count0 = torch.tensor([10**6, 10**6 + 17])
    mean0 = (1000 + 0.1 * torch.randn(B, G, generator=g)).double()
    var0 = (0.5 + torch.rand(B, G, generator=g)).double()
    leaves = [t.float().double() for t in (x, weight, bias, mean0, var0)]
    got = run_fused(leaves, count0, None, G, block_t=8)

    def ref(x, weight, bias, mean0, var0):
        return reference.timestep_norm(x, weight, bias, G, 1e-5, (count0, mean0, var0))

    assert_matches(got, vjp(ref, leaves), where="large state")


def test_the_backward_reads_the_saved_statistics():
    """The backward op takes the per-step statistics the forward saved: given the float64 oracle's values of
    M_t - c and rstd_t instead, it still gives the oracle's gradients (it recomputes no running statistics)."""
    B, L, D, G = 2, 11, 8, 2
    leaves, _, mask = make(B, L, D, G, seed=21, padding=True)
    x, weight, bias = (t.float().to(DEVICE) for t in leaves)
    pad = mask.to(torch.int8).to(DEVICE)
    empty = x.new_empty(0)
    y, mean, var, count, stats, inv_n, shift = torch.ops.mega_suite.timestep_norm_fwd(
        x, weight, bias, empty, empty.clone(), empty.long(), pad, G, 1e-5, 4
    )
    # per-step statistics from float64 sums of the valid steps so far
    xg = leaves[0].reshape(B, L, G, D // G)
    valid = (~mask).double()[:, :, None]
    n = valid.cumsum(1).clamp(min=1)
    m = (xg.mean(-1) * valid).cumsum(1) / n
    m2 = ((xg.square().mean(-1)) * valid).cumsum(1) / n
    rstd = torch.rsqrt(m2 - m.square() + 1e-5)
    ok = ~mask
    torch.testing.assert_close(
        (stats[..., 0] + shift[:, None, :, 0]).cpu()[ok], m.float()[ok], rtol=1e-6, atol=1e-5
    )
    torch.testing.assert_close(stats[..., 1].cpu()[ok], rstd.float()[ok], rtol=1e-5, atol=1e-5)
    exact = torch.stack([(m - shift[:, None, :, 0].cpu().double()), rstd], -1).float().to(DEVICE)
    exact = torch.where(torch.isfinite(exact), exact, stats)
    gy = torch.randn(B, L, D, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    args = (gy, None, None, x, pad, weight, empty.long(), empty, count, exact, inv_n, shift, G, 1e-5, 4)
    dx, dw, db, _, _ = torch.ops.mega_suite.timestep_norm_bwd(*args)
    leaves_x = [t.clone().requires_grad_() for t in leaves]
    y_ref, _ = oracles.timestep_norm(*leaves_x, G, padding_mask=mask)
    grads = torch.autograd.grad(y_ref, leaves_x, gy.double().cpu())
    for a, b in zip((dx, dw, db), grads):
        assert oracles.max_rel_err(a.cpu(), b) <= TOL
    # and a wrong statistic shows: the backward uses what it is given
    planted = exact.clone()
    planted[..., 1] *= 1.01
    dx_planted = torch.ops.mega_suite.timestep_norm_bwd(*args[:9], planted, *args[10:])[0]
    assert oracles.max_rel_err(dx_planted.cpu(), grads[0]) > 10 * TOL


@pytest.mark.parametrize("state", [False, True])
def test_float16_error_within_twice_pytorch(state):
    """float16 x (float32 statistics): the error against float64 is at most 2x that of the PyTorch reference
    given the same float16 input, + 1e-3 (outputs and gradients)."""
    B, L, D, G = 3, 40, 16, 4
    leaves, count, mask = make(B, L, D, G, seed=31, loc=3.0, state=state, padding=True)
    x16 = leaves[0].half().double()  # representable in float16
    leaves = [x16] + leaves[1:]
    want = run_oracle(leaves, count, mask, G)

    def half(module):
        def fn(x, weight, bias, *prior):
            st = None if count is None else (count.to(x.device), *prior)
            m = None if mask is None else mask.to(x.device)
            return module.timestep_norm(x.half(), weight, bias, G, 1e-5, st, m)

        return fn

    got = vjp(half(fused), [t.to(DEVICE, torch.float32) for t in leaves])
    torch_ref = vjp(half(reference), [t.float() for t in leaves])
    (out, grads), (out_t, grads_t), (out_ref, grads_ref) = got, torch_ref, want
    for i, (a, t, b) in enumerate(zip([out[0], out[2], out[3]] + grads, [out_t[0], out_t[2], out_t[3]] + grads_t,
                                      [out_ref[0], out_ref[2], out_ref[3]] + grads_ref)):  # fmt: skip
        err, err_torch = oracles.max_rel_err(a.cpu(), b), oracles.max_rel_err(t, b)
        assert err <= 2 * err_torch + 1e-3, (i, err, err_torch)
    assert out[0].dtype == torch.float16 and grads[0].dtype == torch.float32


def test_one_call_is_six_kernels_and_no_pytorch_op():
    """Forward and backward of a call without a carried state: three Triton launches each (statistics, scan,
    output; sums, scan and dweight / dbias sum, dx) and no PyTorch device operation (no float64 glue)."""
    from device_ops import DeviceOps, counting_launches

    x = torch.randn(2, 9, 8, device=DEVICE, requires_grad=True)
    weight, bias = (torch.zeros(8, device=DEVICE, requires_grad=True) for _ in "wb")
    counter = DeviceOps()
    with counting_launches(counter), counter:
        y, _ = fused.timestep_norm(x, weight, bias, 2)
        y.backward(torch.ones_like(y).detach())
    kernels = {k: v for k, v in counter.ops.items() if k.startswith("triton ")}
    assert sum(kernels.values()) == 6, counter.ops
    others = {k: v for k, v in counter.ops.items() if not k.startswith("triton ")}
    assert others == {"aten.ones_like": 1}, others  # the cotangent, made inside the counter
