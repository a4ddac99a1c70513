"""TimestepNorm and the classification group norm (docs/architecture.md#timestepnorm) against the brute-force float64 oracles of
tests/support/oracles.py: padding, carried state across segments, long float32 sequences with a large mean,
gradients."""

import oracles
import pytest
import torch

from kernels.timestep_norm import group_norm, timestep_norm

F64 = dict(rtol=1e-9, atol=1e-9)


def make_inputs(B, L, D, seed, mean=0.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = mean + torch.randn(B, L, D, generator=g, dtype=torch.float64)
    # Different scales per feature, so that grouping the wrong features changes the statistics.
    x = x * torch.linspace(0.5, 2.0, D, dtype=torch.float64)
    weight = 0.3 * torch.randn(D, generator=g, dtype=torch.float64)
    bias = 0.3 * torch.randn(D, generator=g, dtype=torch.float64)
    return x.to(dtype), weight.to(dtype), bias.to(dtype)


def padding_mask(B, L, seed):
    """Random padding (True = pad): row 0 starts with padding, row 1 is entirely padding, row 2 has
    scattered holes, the rest random."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) < 0.3
    mask[0, : max(1, L // 3)] = True
    mask[1] = True
    mask[2] = torch.arange(L) % 3 == 1
    return mask


def assert_state_close(state, ref, **tol):
    count, mean, var = state
    count_ref, mean_ref, var_ref = ref
    assert count.dtype == torch.int64, count.dtype
    assert torch.equal(count, count_ref), (count, count_ref)
    torch.testing.assert_close(mean, mean_ref, **tol)
    torch.testing.assert_close(var, var_ref, **tol)


def test_oracles_agree():
    """The brute-force and prefix-sum oracles describe the same norm (checks the oracles)."""
    x, weight, bias = make_inputs(4, 30, 8, seed=0, mean=3.0)
    mask = padding_mask(4, 30, seed=1)
    y_ref, _ = oracles.timestep_norm(x, weight, bias, 2, padding_mask=mask)
    torch.testing.assert_close(oracles.timestep_norm_cumulative(x, weight, bias, 2, padding_mask=mask), y_ref)


# --------------------------------------------------------------------------------------------------------
# TimestepNorm forward
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-5, 0.5])
@pytest.mark.parametrize("L", [1, 7, 63, 65])
def test_matches_brute_force(L, eps):
    B, D, G = 2, 12, 3
    x, weight, bias = make_inputs(B, L, D, seed=L, mean=1.5)
    y, state = timestep_norm(x, weight, bias, G, eps=eps)
    y_ref, state_ref = oracles.timestep_norm(x, weight, bias, G, eps=eps)
    assert y.shape == (B, L, D) and y.dtype == torch.float64
    torch.testing.assert_close(y, y_ref, **F64)
    assert_state_close(state, state_ref, **F64)


@pytest.mark.parametrize("L", [1, 7, 63, 65])
def test_padding_matches_brute_force(L):
    """Padded steps output 0 and leave the state unchanged; an all-padding row keeps (0, 0, 1)."""
    B, D, G = 5, 8, 4
    x, weight, bias = make_inputs(B, L, D, seed=10 + L, mean=-2.0)
    mask = padding_mask(B, L, seed=20 + L)
    y, state = timestep_norm(x, weight, bias, G, padding_mask=mask)
    y_ref, state_ref = oracles.timestep_norm(x, weight, bias, G, padding_mask=mask)
    assert torch.isfinite(y).all()
    assert (y[mask] == 0).all()
    torch.testing.assert_close(y, y_ref, **F64)
    assert_state_close(state, state_ref, **F64)
    assert state[0][1] == 0 and (state[1][1] == 0).all() and (state[2][1] == 1).all()


@pytest.mark.parametrize("seed", range(4))
def test_carried_state_equals_one_pass(seed):
    """Cutting the sequence into 2-4 segments at random points and chaining the state gives the one-pass
    outputs and final state (the oracle on the whole sequence)."""
    B, L, D, G = 5, 50, 8, 2
    g = torch.Generator().manual_seed(seed)
    x, weight, bias = make_inputs(B, L, D, seed=30 + seed, mean=5.0)
    mask = padding_mask(B, L, seed=40 + seed)
    y_ref, state_ref = oracles.timestep_norm(x, weight, bias, G, padding_mask=mask)
    n_cuts = int(torch.randint(1, 4, (1,), generator=g))
    cuts = sorted(torch.randperm(L - 1, generator=g)[:n_cuts].add(1).tolist())
    if seed == 0:
        cuts = sorted(set(cuts) | {1, 2})  # include one-step segments
    bounds = [0, *cuts, L]
    state, ys = None, []
    for start, end in zip(bounds[:-1], bounds[1:]):
        y, state = timestep_norm(
            x[:, start:end], weight, bias, G, state=state, padding_mask=mask[:, start:end]
        )
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, 1), y_ref, **F64)
    assert_state_close(state, state_ref, **F64)
    # The kernel's own one-pass run agrees too.
    y_one, state_one = timestep_norm(x, weight, bias, G, padding_mask=mask)
    torch.testing.assert_close(torch.cat(ys, 1), y_one, **F64)
    assert_state_close(state, state_one, **F64)


def test_explicit_initial_state_and_all_padding_segment():
    B, L, D, G = 3, 9, 6, 3
    x, weight, bias = make_inputs(B, L, D, seed=50)
    initial = (
        torch.zeros(B, dtype=torch.int64),
        torch.zeros(B, G, dtype=torch.float64),
        torch.ones(B, G).double(),
    )
    y_ref, s_ref = oracles.timestep_norm(x, weight, bias, G)
    y1, s1 = timestep_norm(x, weight, bias, G, state=initial)
    torch.testing.assert_close(y1, y_ref, **F64)
    assert_state_close(s1, s_ref, **F64)
    # A segment that is padding everywhere outputs 0 and hands the state through unchanged.
    y2, s2 = timestep_norm(x, weight, bias, G, state=s1, padding_mask=torch.ones(B, L, dtype=torch.bool))
    assert (y2 == 0).all()
    assert_state_close(s2, s1, rtol=0, atol=0)


def test_float32_long_sequence_large_mean():
    """L = 65536 steps of N(100, 1): relative error (max |err| / max |ref|) of the float32 kernel against
    float64 on the same float32 inputs is ≤ 1e-5, for y and for the final mean and variance."""
    B, L, D, G = 1, 65536, 32, 4
    x, weight, bias = make_inputs(B, L, D, seed=60, mean=100.0, dtype=torch.float32)
    y, (count, mean, var) = timestep_norm(x, weight, bias, G)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    y_ref = oracles.timestep_norm_cumulative(x, weight, bias, G)
    err = oracles.max_rel_err(y, y_ref)
    assert err <= 1e-5, f"y relative error {err:.2e}"
    xg = x.double().reshape(B, L, G, D // G).transpose(1, 2).reshape(B, G, -1)
    assert int(count[0]) == L
    assert oracles.max_rel_err(mean, xg.mean(-1)) <= 1e-6
    err_var = oracles.max_rel_err(var, xg.var(-1, unbiased=False))
    assert err_var <= 1e-5, f"final variance relative error {err_var:.2e}"


# --------------------------------------------------------------------------------------------------------
# TimestepNorm gradients
# --------------------------------------------------------------------------------------------------------


def _prior_state(B, G, seed):
    g = torch.Generator().manual_seed(seed)
    count = torch.tensor([3, 0, 5][:B], dtype=torch.int64)
    mean = torch.randn(B, G, generator=g, dtype=torch.float64)
    var = 0.5 + torch.rand(B, G, generator=g, dtype=torch.float64)
    return count, mean, var


def test_gradcheck_x_weight_bias():
    B, L, D, G = 2, 4, 4, 2
    x, weight, bias = (t.requires_grad_() for t in make_inputs(B, L, D, seed=70))
    mask = torch.tensor([[True, False, False, True], [False, False, True, False]])

    def f(x, weight, bias):
        y, (_, mean, var) = timestep_norm(x, weight, bias, G, padding_mask=mask)
        return y, mean, var

    assert torch.autograd.gradcheck(f, (x, weight, bias))


def test_gradcheck_incoming_state():
    """docs/architecture.md#chunk-parallelism: gradients flow back through the carried (mean, var) state."""
    B, L, D, G = 2, 3, 4, 2
    x, weight, bias = make_inputs(B, L, D, seed=71)
    count, mean0, var0 = _prior_state(B, G, seed=72)
    inputs = [t.clone().requires_grad_() for t in (x, mean0, var0)]

    def f(x, mean0, var0):
        y, (_, mean, var) = timestep_norm(x, weight, bias, G, state=(count, mean0, var0))
        return y, mean, var

    assert torch.autograd.gradcheck(f, inputs)


def test_explicit_state_matches_virtual_prefix():
    """An arbitrary incoming state (count, mean, var) acts like earlier steps with those statistics: outputs,
    final state and gradients (w.r.t. x, weight, bias, incoming mean and var) equal the brute-force oracle
    run on a synthetic prefix with exactly those statistics followed by x."""
    B, L, D, G = 3, 11, 8, 2
    x, weight, bias = make_inputs(B, L, D, seed=76, mean=1.0)
    count0, mean0, var0 = _prior_state(B, G, seed=77)
    mask = torch.rand(B, L, generator=torch.Generator().manual_seed(78)) < 0.3
    g = torch.Generator().manual_seed(79)
    cot_y = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    cot_mean, cot_var = torch.randn(2, B, G, generator=g, dtype=torch.float64)

    def kernel(x, weight, bias, mean0, var0):
        return timestep_norm(x, weight, bias, G, state=(count0, mean0, var0), padding_mask=mask)

    def oracle(x, weight, bias, mean0, var0):
        prefix, prefix_mask = oracles.virtual_prefix(count0, mean0, var0, D // G)
        n = prefix.shape[1]
        y, state = oracles.timestep_norm(
            torch.cat([prefix, x], 1), weight, bias, G, padding_mask=torch.cat([prefix_mask, mask], 1)
        )
        return y[:, n:], state

    results = []
    for fn in (kernel, oracle):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias, mean0, var0)]
        y, (count, mean, var) = fn(*leaves)
        loss = (y * cot_y).sum() + (mean * cot_mean).sum() + (var * cot_var).sum()
        results.append((y, count, mean, var, torch.autograd.grad(loss, leaves)))
    (y, count, mean, var, grads), (y_ref, count_ref, mean_ref, var_ref, grads_ref) = results
    torch.testing.assert_close(y, y_ref, **F64)
    assert_state_close((count, mean, var), (count_ref, mean_ref, var_ref), **F64)
    for name, got, want in zip(["x", "weight", "bias", "mean0", "var0"], grads, grads_ref):
        torch.testing.assert_close(got, want, **F64, msg=lambda m, name=name: f"grad {name}: {m}")


def test_gradients_match_oracle_with_carried_state():
    """Random cotangents on y and the final (mean, var) of the second of two segments; gradients w.r.t. the
    whole input, weight and bias equal those of the brute-force oracle on the concatenated sequence."""
    B, L, D, G = 3, 20, 6, 3
    x, weight, bias = make_inputs(B, L, D, seed=73, mean=2.0)
    mask = padding_mask(B, L, seed=74)
    g = torch.Generator().manual_seed(75)
    cot_y = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    cot_mean = torch.randn(B, G, generator=g, dtype=torch.float64)
    cot_var = torch.randn(B, G, generator=g, dtype=torch.float64)

    def kernel(x, weight, bias):
        y1, state = timestep_norm(x[:, :8], weight, bias, G, padding_mask=mask[:, :8])
        y2, state = timestep_norm(x[:, 8:], weight, bias, G, state=state, padding_mask=mask[:, 8:])
        return torch.cat([y1, y2], 1), state

    def oracle(x, weight, bias):
        return oracles.timestep_norm(x, weight, bias, G, padding_mask=mask)

    def vjp(fn):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        y, (_, mean, var) = fn(*leaves)
        loss = (y * cot_y).sum() + (mean * cot_mean).sum() + (var * cot_var).sum()
        return torch.autograd.grad(loss, leaves)

    for name, got, want in zip(["x", "weight", "bias"], vjp(kernel), vjp(oracle)):
        torch.testing.assert_close(got, want, **F64, msg=lambda m, name=name: f"grad {name}: {m}")


# --------------------------------------------------------------------------------------------------------
# classification group norm
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-5, 0.5])
@pytest.mark.parametrize("L", [1, 7, 63, 65])
def test_group_norm_matches_oracle(L, eps):
    B, D, G = 5, 12, 4
    x, weight, bias = make_inputs(B, L, D, seed=80 + L, mean=-1.0)
    mask = padding_mask(B, L, seed=90 + L)
    y = group_norm(x, weight, bias, G, eps=eps, padding_mask=mask)
    assert y.shape == (B, L, D) and torch.isfinite(y).all()
    assert (y[mask] == 0).all()
    torch.testing.assert_close(y, oracles.group_norm(x, weight, bias, G, eps=eps, padding_mask=mask), **F64)
    torch.testing.assert_close(
        group_norm(x, weight, bias, G, eps=eps), oracles.group_norm(x, weight, bias, G, eps=eps), **F64
    )


def test_group_norm_appended_padding_leaves_valid_outputs_unchanged():
    B, L, D, G = 3, 17, 8, 2
    x, weight, bias = make_inputs(B, L, D, seed=100)
    y = group_norm(x, weight, bias, G)
    torch.testing.assert_close(y, oracles.group_norm(x, weight, bias, G), **F64)
    extra = 13
    x_padded = torch.cat([x, 50 * torch.randn(B, extra, D, dtype=torch.float64)], 1)
    mask = torch.zeros(B, L + extra, dtype=torch.bool)
    mask[:, L:] = True
    y_padded = group_norm(x_padded, weight, bias, G, padding_mask=mask)
    torch.testing.assert_close(y_padded[:, :L], y, **F64)
    assert (y_padded[:, L:] == 0).all()


def test_group_norm_gradients():
    B, L, D, G = 2, 4, 4, 2
    mask = torch.tensor([[False, True, False, False], [False, False, False, True]])
    x, weight, bias = (t.requires_grad_() for t in make_inputs(B, L, D, seed=110))
    assert torch.autograd.gradcheck(lambda *a: group_norm(*a, G, padding_mask=mask), (x, weight, bias))
    # and against the oracle with a random cotangent, at a larger size
    x, weight, bias = make_inputs(3, 21, 6, seed=111)
    mask = padding_mask(3, 21, seed=112)
    cot = torch.randn(3, 21, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(113))

    def vjp(fn):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        return torch.autograd.grad((fn(*leaves, 3, padding_mask=mask) * cot).sum(), leaves)

    for got, want in zip(vjp(group_norm), vjp(oracles.group_norm)):
        torch.testing.assert_close(got, want, **F64)
