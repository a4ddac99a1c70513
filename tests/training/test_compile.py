"""``trainer.compile``: each block is ``torch.compile``-d in place (``SuiteModule.compile_units``) and the
language model's and the classifier's compiled loss and gradients equal the eager ones.

The backend is ``aot_eager`` (Dynamo capture + AOT autograd, the part our code can break); Inductor's C++
code generation takes minutes on a 2-core CPU, so it is not run here (checked by hand: the same losses,
gradients within 2e-6, see bench/reports/2026-11-24-compile-and-small-models.md).

The test drives the module, not the model: before per-block compilation ``trainer.compile`` wrapped the
whole model, whose ``forward`` the language model's training never calls (it calls ``forward_hidden``), so
nothing was compiled; ``test_every_block_is_compiled`` fails on that code.
"""

import copy
import os
import sys

import model_oracle as tm
import pytest
import torch

from mega_suite.training.module import CausalLM, SequenceClassifier

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = dict(compile=True, compile_backend="aot_eager")
OPTIM = dict(lr=1e-3)


def make(kind: str, compile_: bool):
    torch.manual_seed(0)
    trainer = TRAINER if compile_ else {}
    if kind == "lm":
        module = CausalLM(tm.tiny_config(chunk_size=8), OPTIM, trainer, total_steps=1)
    else:
        module = SequenceClassifier(
            tm.tiny_config(chunk_size=8, num_classes=3), OPTIM, trainer, total_steps=1
        )
    tm.randomise(module.model, seed=1)
    return module


def loss_of(module, kind: str, device: str = "cpu"):
    gen = torch.Generator().manual_seed(0)
    if kind == "lm":
        tokens = torch.randint(0, 13, (2, 17), generator=gen).to(device)
        nll, count = module.lm_loss({"input": tokens[:, :-1], "target": tokens[:, 1:]})
        return nll / count
    batch = {"input": torch.randint(0, 13, (2, 16), generator=gen), "label": torch.tensor([0, 2])}
    batch = {k: v.to(device) for k, v in batch.items()}
    return module.loss(module(batch), batch["label"])


def test_every_block_is_compiled():
    module = make("lm", compile_=True)
    module.configure_model()
    blocks = module.model.compile_units()
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    names = [n for n, _ in module.model.named_parameters()]
    assert not any("_orig_mod" in n for n in names), "compiling must not rename parameters (checkpoints)"
    eager = make("lm", compile_=False)
    eager.configure_model()
    assert all(b._compiled_call_impl is None for b in eager.model.compile_units())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lm", "classifier"])
def test_compiled_loss_equals_eager(kind):
    torch._dynamo.reset()
    eager = make(kind, compile_=False)
    compiled = copy.deepcopy(eager)
    compiled.trainer_cfg.update(TRAINER)
    compiled.configure_model()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    results = []
    for module in (eager, compiled):
        module.model.train()
        torch.manual_seed(3)  # dropout masks: the same draws in both
        loss = loss_of(module, kind)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in module.model.parameters()]))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames, "nothing was compiled"
    (le, ge), (lc, gc) = results
    torch.testing.assert_close(lc, le, rtol=1e-6, atol=1e-6)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["lm", "classifier"])
def test_a_block_compiles_without_graph_breaks(kind):
    """fullgraph=True: the memory-lean pieces (recompute, recompute_saved) step aside under torch.compile.
    Before they did, Dynamo broke the graph at their autograd.grad / storage pointers and ran the block
    eagerly, re-tracing every step (30x slower steps with Inductor)."""
    torch._dynamo.reset()
    module = make(kind, compile_=False)
    block = module.model.compile_units()[0].train()
    x = torch.randn(2, 16, 16, requires_grad=True)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.manual_seed(0)
    out, _ = compiled(x)
    out.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["lm", "classifier"])
def test_inductor_on_cuda_equals_eager(kind, monkeypatch):
    """``trainer.compile=true`` as users get it on a GPU: Inductor (its Triton kernels around our Triton
    custom ops), train mode. ``fallback_random`` makes Inductor draw dropout from the eager generator, so both
    runs drop the same units; the rest differs by fusion order only (float32 rounding)."""
    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    torch._dynamo.reset()
    eager = make(kind, compile_=False).cuda()
    compiled = copy.deepcopy(eager)
    compiled.trainer_cfg.update(compile=True, compile_backend="inductor")
    compiled.configure_model()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    results = []
    for module in (eager, compiled):
        module.model.train()
        torch.manual_seed(3)
        loss = loss_of(module, kind, device="cuda")
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in module.model.parameters()]))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames, "nothing was compiled"
    (le, ge), (lc, gc) = results
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compile_mode_reaches_torch_compile(monkeypatch):
    """``trainer.compile_mode`` is passed to each block's ``compile`` (for "default" on the CPU, Inductor's
    options ``training.module.CPU_INDUCTOR_OPTIONS`` instead: torch.compile takes one or the other), and a
    CUDA-graph mode marks a new step at every training batch (``torch.compiler.cudagraph_mark_step_begin``)."""
    from mega_suite.training.module import CPU_INDUCTOR_OPTIONS

    calls, marks = [], []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append(kw))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    for mode, want in (
        ("default", dict(options=CPU_INDUCTOR_OPTIONS)),
        ("reduce-overhead", dict(mode="reduce-overhead")),
        ("max-autotune", dict(mode="max-autotune")),
        ("max-autotune-no-cudagraphs", dict(mode="max-autotune-no-cudagraphs")),
    ):
        calls.clear()
        module = make("lm", compile_=False)
        module.trainer_cfg.update(compile=True, compile_backend="inductor", compile_mode=mode)
        module.configure_model()
        assert calls and all(c == dict(backend="inductor", **want) for c in calls)
        module.on_train_batch_start({}, 0)
    assert len(marks) == 2  # the two CUDA-graph modes only


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reduce_overhead_on_cuda_equals_eager(monkeypatch):
    """``trainer.compile_mode=reduce-overhead`` (Inductor + CUDA graphs per block): four training steps of the
    LM, each with gradient clipping and an AdamW step (parameters updated in place, at fixed addresses),
    eager and compiled side by side: every step's loss and gradients agree. CUDA-graph trees warm up on the
    first step, record on the second and replay from the third on."""
    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    torch._dynamo.reset()
    eager = make("lm", compile_=False).cuda()
    compiled = copy.deepcopy(eager)
    compiled.trainer_cfg.update(compile=True, compile_backend="inductor", compile_mode="reduce-overhead")
    compiled.configure_model()
    optims = [torch.optim.AdamW(m.model.parameters(), lr=1e-3) for m in (eager, compiled)]
    for step in range(4):
        results = []
        for module, opt in zip((eager, compiled), optims):
            module.model.train()
            module.on_train_batch_start({}, step)
            torch.manual_seed(3 + step)
            loss = loss_of(module, "lm", device="cuda")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.model.parameters(), 1.0)
            results.append((loss.detach().clone(), [p.grad.clone() for p in module.model.parameters()]))
            opt.step()
            opt.zero_grad(set_to_none=True)
        (le, ge), (lc, gc) = results
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
        for a, b in zip(gc, ge):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter (CPU tensors)")
@pytest.mark.parametrize("kind", ["lm", "classifier"])
def test_a_block_on_the_triton_kernels_compiles_whole(kind, monkeypatch):
    """On CUDA a block runs the Triton kernels (attention, CEMA, TimestepNorm). Here they run under the
    Triton interpreter on CPU tensors (dispatch forced to them): ``fullgraph=True`` shows that a compiled
    block on a GPU has no graph break at any of them, and it gives the eager block's outputs and gradients.
    The CEMA and TimestepNorm entry points were ``torch.compiler.disable``d before (a break at each; the
    first H100 lease measured the compiled 7B-width block slower than eager at 4K)."""
    import kernels.cema
    import kernels.dispatch
    import kernels.timestep_norm

    for module in (kernels.dispatch, kernels.cema, kernels.timestep_norm):
        monkeypatch.setattr(module, "use_triton", lambda *tensors: True)
    torch._dynamo.reset()
    module = make(kind, compile_=False)
    block = module.model.compile_units()[0].train()
    x = torch.randn(2, 16, 16)
    results = []
    for run in (block, torch.compile(block, backend="aot_eager", fullgraph=True)):
        leaf = x.clone().requires_grad_()
        torch.manual_seed(0)  # the same dropout and DropKey draws
        out, _ = run(leaf)
        out.square().sum().backward()
        results.append([out.detach(), leaf.grad] + [p.grad.clone() for p in block.parameters()])
        block.zero_grad(set_to_none=True)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _record_host_transfers(monkeypatch) -> list[str]:
    """Where the suite's own code (not torch's, not the Triton interpreter's) makes a tensor from host data
    (``torch.tensor``, ``torch.as_tensor``) or reads a tensor's values on the host (``item``, ``tolist``,
    ``cpu``, ``numpy``, ``bool()``): on CUDA the first is a host-to-device copy and the rest a device-to-host
    sync, and a CUDA graph capture refuses both. Wrapped functions record their caller, since a dispatch mode
    would not see inside the kernels' custom ops (they run with the modes popped)."""
    calls = []

    def wrap(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            frame = sys._getframe(1)
            where = frame.f_code.co_filename
            if where.startswith(ROOT) and "site-packages" not in where:
                calls.append(f"{name} at {where[len(ROOT) :]}:{frame.f_lineno}")
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in ("tensor", "as_tensor"):
        wrap(torch, name)
    for name in ("item", "tolist", "cpu", "numpy", "__bool__"):
        wrap(torch.Tensor, name)
    return calls


CUDA_CASE = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


@pytest.mark.parametrize("device", ["cpu", CUDA_CASE])
@pytest.mark.parametrize("kernels_path", ["triton", "reference"])
@pytest.mark.parametrize("kind", ["lm", "classifier"])
def test_a_block_step_moves_no_data_between_host_and_device(kind, kernels_path, device, monkeypatch):
    """``trainer.compile_mode=reduce-overhead`` captures each block's forward and backward in a CUDA graph,
    and a capture refuses a copy from host memory ("Cannot copy between CPU and CUDA tensors during CUDA graph
    capture"). A tensor made from Python numbers on the GPU (``torch.tensor([...], device=cuda)``) is such a
    copy: the H100 lease of 2026-11-24 failed there, in the Triton CEMA's chunk powers q^T. Reading a value
    on the host (``.item()``, ``bool(t)``) is refused too. One block's training forward and backward, on the
    Triton kernels and on the PyTorch references, do neither: on CPU tensors (the Triton kernels under the
    interpreter) and, marked ``gpu`` (run by gpu-check), on CUDA tensors."""
    triton = kernels_path == "triton"
    if triton and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter or a GPU")
    import kernels.cema
    import kernels.dispatch
    import kernels.timestep_norm

    for module in (kernels.dispatch, kernels.cema, kernels.timestep_norm):
        monkeypatch.setattr(module, "use_triton", lambda *tensors: triton)
    module = make(kind, compile_=False)
    block = module.model.compile_units()[0].train().to(device)
    leaf = torch.randn(2, 16, 16, device=device).requires_grad_()
    calls = _record_host_transfers(monkeypatch)
    out, _ = block(leaf)
    out.square().sum().backward()
    monkeypatch.undo()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    assert calls == [], f"host data or host reads in a block's step: {calls}"
