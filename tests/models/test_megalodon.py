"""One Megalodon block against a float64 oracle of docs/architecture.md#the-block (LM form) and #classifier (classifier form), gradients,
initialisation statistics (docs/architecture.md#cema table, #notation Linear init, #language-model embedding), meta-device builds, classifier
padding invariance and the errors a user can cause.

The oracle (tests/support/model_oracle.py) is written from docs/architecture.md alone with literal loops.
"""

import math
import re

import pytest
import torch
from model_oracle import (
    F64,
    group_norm,
    lm_input,
    oracle_block,
    params_of,
    randomise,
    tiny_config,
)

from mega_suite import MegalodonClassifier, MegalodonLM, create_model
from mega_suite.models.megalodon.block import MegalodonBlock
from mega_suite.models.megalodon.decode import generate

# ----------------------------------------------------------------------------------------------------------
# docs/architecture.md#the-block: the LM block
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,swiglu,layer_scale,length",
    [
        ("auto", True, True, 13),
        ("fft", False, False, 13),
        ("chunked", True, False, 21),
        ("sequential", True, True, 7),
    ],
)
def test_lm_block_matches_oracle(method, swiglu, layer_scale, length):
    cfg = tiny_config(cema_method=method, swiglu=swiglu, layer_scale=layer_scale)
    block = randomise(MegalodonBlock(cfg, layer_index=1).double(), seed=1).eval()
    x = lm_input(2, length, cfg.model_dim, seed=2)
    out, _ = block(x)
    expected, _ = oracle_block(params_of(block), cfg, x)
    torch.testing.assert_close(out, expected, **F64)


def test_lm_block_oracle_is_sensitive_to_the_plus_one_norm_weights():
    """Guard on the test itself: a zero-initialised weight, once randomised, changes the output."""
    cfg = tiny_config()
    block = randomise(MegalodonBlock(cfg).double(), seed=3).eval()
    x = lm_input(1, 9, cfg.model_dim, seed=4)
    P = params_of(block)
    ref, _ = oracle_block(P, cfg, x)
    for name in ("mega.timenorm.weight", "mega.rmsnorm.weight", "mega.gamma", "nffn.norm.weight"):
        Q = dict(P, **{name: torch.zeros_like(P[name])})
        assert (oracle_block(Q, cfg, x)[0] - ref).abs().max() > 1e-3, name


@pytest.mark.parametrize("rebuild", ["always", "never"])
def test_lm_block_gradients_match_oracle(rebuild):
    """``rebuild``: model.recompute_linears (X̂ W_v + b, M W_r + b, u W_1, u W_3 rebuilt in backward)."""
    cfg = tiny_config(layer_scale=True, recompute_linears=rebuild)
    block = randomise(MegalodonBlock(cfg, layer_index=1).double(), seed=5).eval()
    x = lm_input(2, 12, cfg.model_dim, seed=6).requires_grad_()
    cot = torch.randn(2, 12, cfg.model_dim, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    names = [n for n, _ in block.named_parameters()]
    out, _ = block(x)
    got = torch.autograd.grad((out * cot).sum(), [x, *block.parameters()])

    P = params_of(block, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ref_out, _ = oracle_block(P, cfg, x2)
    want = torch.autograd.grad((ref_out * cot).sum(), [x2, *(P[n] for n in names)])
    for name, a, b in zip(["input", *names], got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9, msg=lambda m, n=name: f"grad of {n}: {m}")


# ----------------------------------------------------------------------------------------------------------
# docs/architecture.md#classifier: the classifier block
# ----------------------------------------------------------------------------------------------------------


def classifier_config(**overrides):
    return tiny_config(num_classes=3, **overrides)


@pytest.mark.parametrize("padded", [False, True])
def test_classifier_block_matches_oracle(padded):
    cfg = classifier_config()
    block = randomise(MegalodonBlock(cfg).double(), seed=8).eval()
    x = lm_input(3, 13, cfg.model_dim, seed=9)
    mask = None
    if padded:  # row 1: last chunk (steps 10-12) entirely padding; row 2: padding inside a chunk
        mask = torch.zeros(3, 13, dtype=torch.bool)
        mask[1, 9:] = True
        mask[2, 7:] = True
        x = x.masked_fill(mask[..., None], 0.0)
    out, _ = block(x, padding_mask=mask)
    expected, _ = oracle_block(params_of(block), cfg, x, classifier=True, padding_mask=mask)
    valid = torch.ones(3, 13, dtype=torch.bool) if mask is None else ~mask
    torch.testing.assert_close(out[valid], expected[valid], **F64)


@pytest.mark.parametrize("rebuild", ["always", "never"])
def test_classifier_block_gradients_match_oracle(rebuild):
    cfg = classifier_config(swiglu=False, recompute_linears=rebuild)
    block = randomise(MegalodonBlock(cfg).double(), seed=10).eval()
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, 6:] = True
    x = lm_input(2, 11, cfg.model_dim, seed=11).masked_fill(mask[..., None], 0.0).requires_grad_()
    cot = torch.randn(2, 11, cfg.model_dim, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    cot = cot * (~mask)[..., None]  # outputs at padded steps are not specified
    names = [n for n, _ in block.named_parameters()]
    out, _ = block(x, padding_mask=mask)
    got = torch.autograd.grad((out * cot).sum(), [x, *block.parameters()])

    P = params_of(block, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    ref_out, _ = oracle_block(P, cfg, x2, classifier=True, padding_mask=mask)
    want = torch.autograd.grad((ref_out * cot).sum(), [x2, *(P[n] for n in names)])
    for name, a, b in zip(["input", *names], got, want, strict=True):
        if name == "input":  # padded inputs are never read
            a, b = a[~mask], b[~mask]
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9, msg=lambda m, n=name: f"grad of {n}: {m}")


# ----------------------------------------------------------------------------------------------------------
# initialisation (docs/architecture.md: #notation Linear, #cema table, #timestepnorm norms, #language-model embedding)
# ----------------------------------------------------------------------------------------------------------

TRUNC3_STD = 0.986572  # std of N(0, 1) truncated at ±3σ


def assert_std(t, expected, rel, what):
    t = t.detach().double().flatten()
    assert abs(t.mean().item()) < 5 * expected / math.sqrt(t.numel()), f"{what}: mean {t.mean().item()}"
    assert abs(t.std().item() / expected - 1) < rel, (
        f"{what}: std {t.std().item():.5f}, expected {expected:.5f}"
    )


def check_initial_statistics(model: MegalodonLM):
    cfg = model.cfg
    D, N = cfg.model_dim, cfg.cema_ndim
    for i, layer in enumerate(model.layers):
        mega, nffn = layer.mega, layer.nffn
        linears = dict(wz=mega.wz, wv=mega.wv, wr=mega.wr, wh1=mega.wh1, wh2=mega.wh2)
        linears.update(fc1=nffn.fc1, fc2=nffn.fc2, fc3=nffn.fc3)
        for name, lin in linears.items():
            fan_in = lin.weight.shape[1]
            assert_std(lin.weight, 1 / math.sqrt(3 * fan_in), 0.04, f"layers.{i} {name}.weight")
            if lin.bias is not None:
                assert torch.all(lin.bias == 0), f"layers.{i} {name}.bias"
        assert (
            mega.wh2.bias is None
            and nffn.fc1.bias is None
            and nffn.fc2.bias is None
            and nffn.fc3.bias is None
        )
        for name in ("timenorm.weight", "timenorm.bias", "rmsnorm.weight", "gamma", "beta"):
            assert torch.all(mega.get_parameter(name) == 0), f"layers.{i}.mega.{name} not zero-initialised"
        assert torch.all(nffn.norm.weight == 0) and torch.all(nffn.norm.bias == 0)
        if cfg.layer_scale:
            torch.testing.assert_close(nffn.alpha, torch.full((D,), 0.1 * 0.5**i))
        cema = mega.cema
        assert (
            cema.alpha.shape == (D, N, 1) and cema.delta.shape == (D, N, 1) and cema.theta.shape == (D, 1, 1)
        )
        assert cema.gamma.shape == (D, N, 2) and cema.omega.shape == (D, 1)
        assert_std(cema.alpha, 0.2, 0.08, "cema.alpha")
        assert_std(cema.delta, 0.2, 0.08, "cema.delta")
        assert_std(cema.gamma[..., 0], 1.0, 0.08, "cema.gamma real")
        assert torch.all(cema.gamma[..., 1] == 0), "cema.gamma imaginary part must start at 0"
        assert cema.omega.abs().max() <= 1.0
        assert_std(cema.omega, 0.25, 0.2, "cema.omega")
        # theta = logit(D^(-π(d)/D)): recover π(d) = -log(sigmoid(theta)) · D / log D, a permutation of 1..D
        ranks = -torch.log(torch.sigmoid(cema.theta.double().flatten())) * D / math.log(D)
        assert torch.allclose(ranks, ranks.round(), atol=1e-3), "theta is not logit(D^(-k/D)) for integer k"
        assert torch.equal(ranks.round().long().sort().values, torch.arange(1, D + 1)), (
            "π is not a permutation"
        )
        assert not torch.equal(ranks.round().long(), torch.arange(1, D + 1)), "π is the identity, not random"
        tn = mega.timenorm
        assert tn.prior_count.item() == 0 and torch.all(tn.prior_mean == 0) and torch.all(tn.prior_logv == 0)
    emb = model.embed.weight
    std = D**-0.5
    assert emb.abs().max() <= 3 * std + 1e-7, "embedding not truncated at ±3σ"
    assert emb.abs().max() > 2.5 * std, "embedding truncated too tightly"
    assert_std(emb, std * TRUNC3_STD, 0.02, "embed.weight")
    fn = model.output.final_norm
    assert torch.all(fn.weight == 0) and torch.all(fn.bias == 0)


def moderate_config(**overrides):
    return dict(
        num_layers=2, model_dim=256, num_heads=2, z_dim=128, value_dim=512, ffn_hidden_dim=512, swiglu=True,
        cema_ndim=16, norm_num_groups=16, vocab_size=1024, layer_scale=True, **overrides,
    )  # fmt: skip


def test_initial_statistics():
    torch.manual_seed(0)
    check_initial_statistics(create_model("megalodon_debug", **moderate_config()))


def test_meta_build_then_to_empty_and_init_weights():
    torch.manual_seed(1)
    model = create_model("megalodon_debug", device="meta", **moderate_config())
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    with torch.no_grad():  # poison everything, so anything init_weights forgets shows
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(float("nan") if t.is_floating_point() else 7)
    model.init_weights()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(t.float()).all(), f"{name} not finite after init_weights"
    check_initial_statistics(model)


def test_meta_build_keeps_tied_embedding():
    """share_emb: output projection and embedding are one parameter after to_empty + init_weights too."""
    model = create_model("megalodon_debug", device="meta", share_emb=True)
    model.to_empty(device="cpu")
    model.init_weights()
    tied = model.output.output.weight is model.embed.weight
    assert tied, "after to_empty + init_weights, output.output.weight is no longer embed.weight"


@pytest.mark.parametrize("input_type", ["token", "scalar", "patch"])
def test_classifier_meta_build_matches_direct_init(input_type):
    cfg = classifier_config(
        input_type=input_type, model_dim=64, vocab_size=4096, image_size=32, patch_size=16
    )
    torch.manual_seed(2)
    direct = MegalodonClassifier(cfg)
    with torch.device("meta"):
        model = MegalodonClassifier(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(t.float()).all(), f"{name} not finite after init_weights"
    for (name, a), (_, b) in zip(direct.named_parameters(), model.named_parameters(), strict=True):
        if a.numel() >= 1024:  # same initial distribution as the constructor's
            sa, sb = a.std().item(), b.std().item()
            assert abs(sa / sb - 1) < 0.1, (
                f"{name}: std {sb:.4f} after init_weights, {sa:.4f} when built directly"
            )
        elif torch.all(a == 0):
            assert torch.all(b == 0), name
    if input_type == "token":
        assert_std(model.encoder.embed.weight, 64**-0.5 * TRUNC3_STD, 0.03, "encoder.embed.weight")


# ----------------------------------------------------------------------------------------------------------
# docs/architecture.md#classifier classifier: padding never changes valid outputs
# ----------------------------------------------------------------------------------------------------------


def make_classifier(seed, **overrides):
    cfg = classifier_config(**overrides)
    torch.manual_seed(seed)
    return randomise(MegalodonClassifier(cfg).double(), seed=seed).eval()


def random_inputs(kind, B, L, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind == "token":
        return torch.randint(0, 13, (B, L), generator=gen)
    return torch.randn(B, L, generator=gen, dtype=torch.float64)


def oracle_classifier(model, x, mask, x2=None, mask2=None):
    """docs/architecture.md#classifier: encoder -> blocks -> final group norm -> masked mean -> Linear, GELU, Linear (no bias)."""
    cfg = model.cfg

    def encode(x, mask):
        if cfg.input_type == "token":
            h = model.encoder.embed.weight.detach()[x] * (math.sqrt(cfg.model_dim) if cfg.scale_emb else 1.0)
        else:
            h = x[..., None] * model.encoder.weight.detach() + model.encoder.bias.detach()
        valid = (~mask)[..., None].double()
        h = h * valid
        for layer in model.layers:
            h, _ = oracle_block(params_of(layer), cfg, h, classifier=True, padding_mask=mask)
        fn = model.final_norm
        h = group_norm(h, fn.weight.detach(), fn.bias.detach(), cfg.norm_num_groups, cfg.norm_eps, mask)
        return (h * valid).sum(1) / valid.sum(1)

    pooled = encode(x, mask)
    if cfg.dual_input:
        pooled = torch.cat([pooled, encode(x2, mask2)], -1)
    head = model.head
    a = pooled @ head.fc1.weight.detach().T + head.fc1.bias.detach()
    a = 0.5 * a * (1 + torch.erf(a / math.sqrt(2)))
    return a @ head.fc2.weight.detach().T


@pytest.mark.parametrize("kind,dual", [("token", False), ("scalar", False), ("token", True)])
def test_classifier_matches_oracle(kind, dual):
    model = make_classifier(24, input_type=kind, dual_input=dual, scale_emb=True)
    x, x2 = random_inputs(kind, 2, 12, seed=25), random_inputs(kind, 2, 9, seed=26)
    mask = torch.arange(12)[None, :] >= torch.tensor([12, 7])[:, None]
    mask2 = torch.arange(9)[None, :] >= torch.tensor([4, 9])[:, None]
    got = model(x, padding_mask=mask, x2=x2, padding_mask2=mask2)
    torch.testing.assert_close(got, oracle_classifier(model, x, mask, x2, mask2), **F64)


@pytest.mark.parametrize("kind", ["token", "scalar"])
def test_classifier_appended_padding_leaves_logits_unchanged(kind):
    model = make_classifier(13, input_type=kind)
    x = random_inputs(kind, 2, 11, seed=14)
    ref = model(x)
    junk = random_inputs(kind, 2, 6, seed=15)  # padded steps hold junk, not zeros
    xp = torch.cat([x, junk], 1)
    mask = torch.zeros(2, 17, dtype=torch.bool)
    mask[:, 11:] = True
    torch.testing.assert_close(model(xp, padding_mask=mask), ref, **F64)
    # and padding does matter when it is not masked
    assert (model(xp) - ref).abs().max() > 1e-6


@pytest.mark.parametrize("kind", ["token", "scalar"])
def test_classifier_padding_inside_the_batch(kind):
    model = make_classifier(16, input_type=kind)
    lengths = [12, 4, 9]
    x = random_inputs(kind, 3, 12, seed=17)
    mask = torch.arange(12)[None, :] >= torch.tensor(lengths)[:, None]
    batched = model(x, padding_mask=mask)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(batched[b], model(x[b : b + 1, :n])[0], **F64)


def test_retrieval_dual_input_padding_invariance():
    model = make_classifier(18, input_type="token", dual_input=True)
    u, v = random_inputs("token", 2, 8, seed=19), random_inputs("token", 2, 13, seed=20)
    ref = model(u, x2=v)
    up = torch.cat([u, random_inputs("token", 2, 5, seed=21)], 1)
    vp = torch.cat([v, random_inputs("token", 2, 3, seed=22)], 1)
    mu = torch.arange(13)[None].expand(2, -1) >= 8
    mv = torch.arange(16)[None].expand(2, -1) >= 13
    torch.testing.assert_close(model(up, padding_mask=mu, x2=vp, padding_mask2=mv), ref, **F64)
    # the two documents are not interchangeable: the head sees [u, v]
    assert (model(v, x2=u) - ref).abs().max() > 1e-6


def test_patch_classifier_shapes_and_errors():
    model = make_classifier(23, input_type="patch", image_size=32, patch_size=16, in_chans=3)
    assert model(torch.randn(2, 3, 32, 32, dtype=torch.float64)).shape == (2, 3)
    for shape in [(2, 1, 32, 32), (2, 3, 31, 32), (2, 3, 32)]:
        with pytest.raises(ValueError, match=r"\[B, 3, 32, 32\].*" + re_shape(shape)):
            model(torch.randn(*shape, dtype=torch.float64))


def re_shape(shape):
    return re.escape(str(tuple(shape)))


# ----------------------------------------------------------------------------------------------------------
# errors a user can cause name the offending value
# ----------------------------------------------------------------------------------------------------------


def test_lm_rejects_tokens_of_wrong_rank():
    model = MegalodonLM(tiny_config())
    for shape in [(7,), (2, 3, 4)]:
        with pytest.raises(ValueError, match=re_shape(shape)):
            model(torch.zeros(shape, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(1, 0\)"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)


def test_classifier_rejects_bad_inputs():
    model = MegalodonClassifier(classifier_config())
    x = torch.zeros(2, 9, dtype=torch.long)
    with pytest.raises(ValueError, match=re_shape((2, 9)) + ".*" + re_shape((2, 8))):
        model(x, padding_mask=torch.zeros(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=re_shape((2, 9, 1))):
        model(torch.zeros(2, 9, 1, dtype=torch.long))
    scalar = MegalodonClassifier(classifier_config(input_type="scalar"))
    with pytest.raises(ValueError, match=re_shape((2, 9, 3))):
        scalar(torch.zeros(2, 9, 3))
    dual = MegalodonClassifier(classifier_config(dual_input=True))
    with pytest.raises(ValueError, match="x2"):
        dual(x)


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="model_dim=18"):
        tiny_config(model_dim=18)  # not divisible by 4 groups
    with pytest.raises(ValueError, match="z_dim=6"):
        tiny_config(z_dim=6)  # 3 per head: RoPE needs pairs
    with pytest.raises(ValueError, match="'bogus'"):
        tiny_config(cema_method="bogus")
