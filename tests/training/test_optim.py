"""The optimiser of both LightningModules: the lr schedule at chosen steps (values worked out by hand from
"linear warmup, then linear / cosine decay to min_lr_ratio, or constant"), the lr actually used at each step of a
Trainer run, the no-decay groups (docs/architecture.md#paper-vs-reference-code: an option; by default every parameter is decayed, as the reference
code), and gradient clipping in ``on_before_optimizer_step``.
"""

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.training.module import CausalLM, SequenceClassifier, lr_lambda

TINY = dict(
    num_layers=2, model_dim=16, num_heads=2, z_dim=8, value_dim=16, ffn_hidden_dim=16, cema_ndim=4,
    norm_num_groups=4, chunk_size=4, vocab_size=11, swiglu=True, layer_scale=True,
)  # fmt: skip


def optim(**overrides):
    base = dict(lr=2e-3, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-7, schedule="linear", warmup_steps=0,
                min_lr_ratio=0.0, clip_grad_norm=1.0, no_decay_groups=False)  # fmt: skip
    base.update(overrides)
    return base


def lm_module(total_steps=100, model=None, **optim_overrides):
    cfg = MegalodonConfig(**{**TINY, **(model or {})})
    return CausalLM(cfg, optim=optim(**optim_overrides), trainer={}, total_steps=total_steps)


# ----------------------------------------------------------------------------------------------------------
# schedule
# ----------------------------------------------------------------------------------------------------------

# (schedule, warmup, total, min_ratio, {step: multiplier}); the multiplier at optimizer step s (0-based)
# is (s + 1) / warmup during warmup, so the first step already trains and step warmup − 1 reaches the peak.
SCHEDULE_CASES = [
    (
        "linear",
        10,
        110,
        0.0,
        {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 35: 0.75, 60: 0.5, 109: 0.01, 110: 0.0, 500: 0.0},
    ),
    ("linear", 10, 110, 0.2, {0: 0.1, 10: 1.0, 60: 0.6, 110: 0.2, 500: 0.2}),
    # cosine: 0.1 + 0.9 · ½ (1 + cos(π · progress)); progress ¼ -> 0.1 + 0.45 · (1 + √½) = 0.868198051533946
    ("cosine", 10, 110, 0.1, {0: 0.1, 9: 1.0, 10: 1.0, 35: 0.868198051533946, 60: 0.55, 110: 0.1, 999: 0.1}),
    ("cosine", 0, 100, 0.0, {0: 1.0, 50: 0.5, 100: 0.0}),
    ("constant", 4, 100, 0.0, {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 99: 1.0, 1000: 1.0}),
    ("linear", 0, 100, 0.0, {0: 1.0, 25: 0.75, 100: 0.0}),
]


@pytest.mark.parametrize("schedule,warmup,total,min_ratio,expected", SCHEDULE_CASES)
def test_lr_lambda_values(schedule, warmup, total, min_ratio, expected):
    f = lr_lambda(schedule, warmup, total, min_ratio)
    for step, want in expected.items():
        assert f(step) == pytest.approx(want, rel=1e-12, abs=1e-15), f"{schedule} step {step}"


def test_configured_scheduler_follows_lr_lambda_per_step():
    module = lm_module(total_steps=30, schedule="cosine", warmup_steps=5, min_lr_ratio=0.1)
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    assert conf["lr_scheduler"]["interval"] == "step", "the schedule is in optimizer steps, not epochs"
    f = lr_lambda("cosine", 5, 30, 0.1)
    for step in range(35):
        assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 * f(step), rel=1e-12), step
        opt.step()
        sched.step()


def test_trainer_uses_the_scheduled_lr_at_every_step():
    """A real fit: the lr seen by optimizer step s is peak · f(s) (LambdaLR stepped once per optimizer step)."""
    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    torch.manual_seed(0)
    module = lm_module(total_steps=6, schedule="linear", warmup_steps=3)
    tokens = torch.randint(0, 11, (6, 2, 8))
    loader = DataLoader([{"input": t, "target": t.roll(-1, 1)} for t in tokens], batch_size=None)
    trainer = L.Trainer(
        max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Record()],
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    # warmup 1/3, 2/3, 1; then linear over the remaining 3 steps: 1, 2/3, 1/3
    expected = [2e-3 * m for m in (1 / 3, 2 / 3, 1.0, 1.0, 2 / 3, 1 / 3)]
    assert seen == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------------------------------------
# weight-decay groups
# ----------------------------------------------------------------------------------------------------------

LINEAR_MAPS = ("wz", "wv", "wr", "wh1", "wh2", "fc1", "fc2", "fc3")


def expected_decayed(names, extra=()):
    """Only the weight matrices of the linear maps are decayed; norms (weights, biases), CEMA parameters,
    embeddings, biases, Q/K γ and β and the layer scale α are not."""
    return {n for n in names if n.endswith(".weight") and n.split(".")[-2] in LINEAR_MAPS} | set(extra)


def groups_by_name(module):
    conf = module.configure_optimizers()
    opt = conf["optimizer"]
    name_of = {id(p): n for n, p in module.model.named_parameters()}
    groups = [([name_of[id(p)] for p in g["params"]], g["weight_decay"]) for g in opt.param_groups]
    all_names = [n for names, _ in groups for n in names]
    assert sorted(all_names) == sorted(name_of.values()), "every parameter in exactly one group"
    return groups, opt


def test_default_decays_every_parameter():
    """docs/architecture.md#paper-vs-reference-code: the reference code decays every parameter, so that is the default."""
    module = lm_module()
    groups, opt = groups_by_name(module)
    assert len(groups) == 1 and groups[0][1] == 0.1
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-7 and opt.defaults["lr"] == 2e-3
    assert isinstance(opt, torch.optim.AdamW)


@pytest.mark.parametrize("share_emb", [False, True])
def test_no_decay_groups_lm(share_emb):
    module = lm_module(model=dict(share_emb=share_emb), no_decay_groups=True)
    (decay, wd), (no_decay, wd0) = groups_by_name(module)[0]
    names = decay + no_decay
    want = expected_decayed(names, [] if share_emb else ["output.output.weight"])
    assert (wd, wd0) == (0.1, 0.0)
    assert set(decay) == want, f"decayed but should not be: {set(decay) - want}; missing: {want - set(decay)}"
    for must_be_exempt in (
        "embed.weight", "layers.0.mega.timenorm.weight", "layers.0.mega.timenorm.bias",
        "layers.1.mega.rmsnorm.weight", "layers.0.mega.cema.alpha", "layers.0.mega.cema.delta",
        "layers.0.mega.cema.theta", "layers.0.mega.cema.gamma", "layers.0.mega.cema.omega", "layers.0.mega.gamma",
        "layers.0.mega.beta", "layers.0.mega.wz.bias", "layers.1.mega.wh1.bias", "layers.0.nffn.norm.weight",
        "layers.0.nffn.norm.bias", "layers.1.nffn.alpha", "output.final_norm.weight", "output.final_norm.bias",
    ):  # fmt: skip
        assert must_be_exempt in no_decay, must_be_exempt


def test_no_decay_groups_token_classifier():
    cfg = MegalodonConfig(**TINY, num_classes=3)
    module = SequenceClassifier(cfg, optim=optim(no_decay_groups=True), trainer={}, total_steps=10)
    (decay, _), (no_decay, _) = groups_by_name(module)[0]
    assert set(decay) == expected_decayed(decay + no_decay, ["head.fc1.weight", "head.fc2.weight"])
    assert {"encoder.embed.weight", "head.fc1.bias", "final_norm.weight"} <= set(no_decay)


def test_no_decay_groups_patch_classifier_exempts_position_embedding():
    cfg = MegalodonConfig(**TINY, num_classes=3, input_type="patch", image_size=8, patch_size=4, in_chans=3)
    module = SequenceClassifier(cfg, optim=optim(no_decay_groups=True), trainer={}, total_steps=10)
    (decay, _), (no_decay, _) = groups_by_name(module)[0]
    assert "encoder.proj.bias" in no_decay
    assert "encoder.pos" in no_decay


# ----------------------------------------------------------------------------------------------------------
# gradient clipping
# ----------------------------------------------------------------------------------------------------------


def backward_with_grads(module, scale):
    torch.manual_seed(3)
    tokens = torch.randint(0, 11, (2, 9))
    nll, _ = module.lm_loss({"input": tokens, "target": tokens.roll(-1, 1)})
    (scale * nll).backward()
    return {n: p.grad.detach().clone().double() for n, p in module.model.named_parameters()}


def global_norm(grads):
    return math.sqrt(sum(float((g * g).sum()) for g in grads.values()))


@pytest.mark.parametrize("clip,scale", [(0.5, 10.0), (1e6, 1.0), (0.0, 10.0)])
def test_on_before_optimizer_step_clips_the_global_norm(monkeypatch, clip, scale):
    """The global 2-norm over all gradients is scaled to clip_grad_norm when larger (every gradient by the same
    factor clip / norm), left as is otherwise; clip_grad_norm = 0 disables clipping."""
    module = lm_module(clip_grad_norm=clip)
    logged = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kw: logged.__setitem__(name, float(value)))
    before = backward_with_grads(module, scale)
    norm = global_norm(before)
    assert norm > 1.0, "the test needs a gradient norm above the clip value"
    module.on_before_optimizer_step(module.configure_optimizers()["optimizer"])
    after = {n: p.grad.detach().double() for n, p in module.model.named_parameters()}
    factor = clip / norm if 0 < clip < norm else 1.0
    for n in before:
        torch.testing.assert_close(after[n], before[n] * factor, rtol=1e-5, atol=1e-9, msg=n)
    assert global_norm(after) == pytest.approx(min(norm, clip) if clip > 0 else norm, rel=1e-5)
    assert logged["train/grad_norm"] == pytest.approx(norm, rel=1e-5), "the logged norm is the pre-clip norm"


# ----------------------------------------------------------------------------------------------------------
# AdamW's kernels
# ----------------------------------------------------------------------------------------------------------


def adamw_float64(params, grads, steps, lr, betas, eps, weight_decay):
    """AdamW written from its definition (Loshchilov & Hutter; torch's bias-corrected form), in float64:
    θ ← θ(1 − lr·λ); m ← β1 m + (1 − β1) g; v ← β2 v + (1 − β2) g²;
    θ ← θ − lr · (m / (1 − β1ᵗ)) / (√(v / (1 − β2ᵗ)) + ε)."""
    (b1, b2), out = betas, []
    for p, gs in zip(params, grads):
        p = p.double().clone()
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        for t in range(1, steps + 1):
            g = gs[t - 1].double()
            p = p * (1 - lr * weight_decay)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            p = p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        out.append(p)
    return out


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_adamw_implementation_is_used_and_steps_as_adamw(implementation):
    """``optim.implementation`` picks torch's AdamW kernels (fused: one kernel for every parameter, the
    default); each takes the same steps as AdamW written out in float64."""
    torch.manual_seed(0)
    module = lm_module(implementation=implementation, schedule="constant", clip_grad_norm=0.0)
    opt = module.configure_optimizers()["optimizer"]
    want = {"fused": (True, None), "foreach": (None, True), "for-loop": (None, False)}[implementation]
    assert all((g["fused"], g["foreach"]) == want for g in opt.param_groups)
    params = [p for p in module.model.parameters()]
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn_like(p) for _ in range(3)] for p in params]
    for t in range(3):
        for p, g in zip(params, grads):
            p.grad = g[t].clone()
        opt.step()
    oracle = adamw_float64(start, grads, 3, lr=2e-3, betas=(0.9, 0.95), eps=1e-7, weight_decay=0.1)
    for p, o in zip(params, oracle):
        torch.testing.assert_close(p.detach().double(), o, rtol=1e-6, atol=1e-6)


def test_default_implementation_is_fused():
    from mega_suite.config import OptimSection

    assert OptimSection().implementation == "fused"
    opt = lm_module().configure_optimizers()["optimizer"]  # a config without the key (an older run): fused
    assert all(g["fused"] is True for g in opt.param_groups)


def fit_tiny(module, tmp_path, steps, ckpt_path=None, callbacks=()):
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (8, 2, 8))
    loader = DataLoader([{"input": t, "target": t.roll(-1, 1)} for t in tokens], batch_size=None)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=list(callbacks),
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return trainer


def test_resumed_run_uses_the_configured_adamw_kernels(tmp_path, monkeypatch):
    """A checkpoint saved with the for-loop AdamW (as every run before optim.implementation) keeps its param
    groups' flags, which the optimizer's load_state_dict restores: the run resumed with the default must
    still step with the fused kernel, from the saved moments and step counts."""
    old = fit_tiny(lm_module(implementation="for-loop"), tmp_path, 2)
    ckpt = tmp_path / "old.ckpt"
    old.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]["param_groups"][0]
    assert (saved["fused"], saved["foreach"]) == (None, False)

    calls = []
    fused = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(1), fused(*a, **k))[1])
    seen = []

    class Flags(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            opt = trainer.optimizers[0]
            seen.append(
                ([g["fused"] for g in opt.param_groups], [int(s["step"]) for s in opt.state.values()])
            )

    fit_tiny(lm_module(), tmp_path, 4, ckpt_path=ckpt, callbacks=[Flags()])
    assert len(calls) == 2, "steps 3 and 4 ran the fused kernel"
    assert all(flags == [True] for flags, _ in seen)
    assert {tuple(set(steps)) for _, steps in seen} == {(2,), (3,)}, "the saved step counts carried on"
