"""Chunk parallelism (docs/architecture.md#chunk-parallelism) on CPU over gloo: P ranks holding chunk-aligned slices of the same sequences
give the logits, the whole-sequence mean loss and the gradients (every parameter, every rank's input
embeddings) of the single-process full pass; one long document split across ranks gives the streaming NLL."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from spawn_support import free_port, spawn

from mega_suite.distributed.chunk_parallel import (
    ChunkParallelContext,
    _h0_term,
    attach,
    global_mean_loss,
    is_attached,
    reduce_gradients,
    slice_batch,
    slice_bounds,
    slice_norm_stats,
)
from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.models.megalodon.lm import MegalodonLM

CFG = dict(
    num_layers=2, model_dim=16, num_heads=2, z_dim=8, value_dim=16, ffn_hidden_dim=24, swiglu=True,
    cema_ndim=4, norm_num_groups=4, chunk_size=4, vocab_size=23,
)  # fmt: skip
EOS = 0


def _packed_batch(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Padding-free packed documents: a token stream with EOS between documents, cut into length + 1."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, CFG["vocab_size"], (batch, length + 1), generator=g)
    seq[torch.rand(batch, length + 1, generator=g) < 0.15] = EOS  # document boundaries anywhere
    return {"input": seq[:, :-1], "target": seq[:, 1:]}


def _model(dtype: torch.dtype) -> MegalodonLM:
    torch.manual_seed(0)
    model = MegalodonLM(MegalodonConfig(**CFG)).to(dtype)
    with torch.no_grad():  # non-trivial norm affine and a large input mean stress the merge
        for name, p in model.named_parameters():
            if name.endswith(("timenorm.bias", "final_norm.bias")):
                p.add_(torch.randn_like(p) * 0.5 + 3.0)
    return model


def _step(model: MegalodonLM, batch: dict, cp: ChunkParallelContext | None = None):
    """Loss, logits, parameter gradients and the gradient of the input embeddings of one step."""
    model.zero_grad(set_to_none=True)
    embedded = []

    def keep(module, inputs, out):
        out.retain_grad()
        embedded.append(out)

    handle = model.embed.register_forward_hook(keep)
    try:
        if cp is None:
            hidden, _ = model.forward_hidden(batch["input"])
            loss = model.token_nll(hidden, batch["target"]).sum() / batch["target"].numel()
        else:
            with cp.attached(model):
                hidden, _ = model.forward_hidden(batch["input"])
                nll = model.token_nll(hidden, batch["target"]).sum()
                loss = global_mean_loss(nll, torch.tensor(batch["target"].numel()), cp)
                loss.backward()
            reduce_gradients(model, cp)
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=cp.group)
    finally:
        handle.remove()
    if cp is None:
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), model.logits(hidden).detach(), grads, embedded[0].grad.detach().clone()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _train_worker(rank: int, world: int, port: int, dtype_name: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        dtype = getattr(torch, dtype_name)
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        model = _model(dtype)
        batch = _packed_batch(2, 8 * world, seed=1)
        ref_loss, ref_logits, ref_grads, ref_embed = _step(model, batch)
        start, stop = slice_bounds(batch["input"].shape[1], world, CFG["chunk_size"])[rank]
        mine = slice_batch(batch, rank, world, CFG["chunk_size"])
        for mode in ("parallel", "sequential"):
            cp = ChunkParallelContext.from_group(None, mode=mode)
            loss, logits, grads, embed = _step(model, mine, cp)
            where = f"rank {rank}/{world} {mode} {dtype_name}"
            assert _rel(loss, ref_loss) <= tol, f"{where}: loss {loss} vs {ref_loss}"
            assert _rel(logits, ref_logits[:, start:stop]) <= tol, f"{where}: logits"
            assert _rel(embed, ref_embed[:, start:stop]) <= tol, f"{where}: input-embedding gradient"
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                assert _rel(g, ref_grads[name]) <= tol, (
                    f"{where}: grad {name} off by {_rel(g, ref_grads[name])}"
                )
            assert cp.stats.bytes_sent > 0 or world == 1
        if dtype == torch.float64:
            _eval_document(model, rank, world)
            _padded_layers(model, rank, world)
            if world == 4:  # the slow case: importing Lightning costs ~10 s a process on 2 cores
                _validation_step(model, rank, world)
            else:  # one spawn for these (a spawn costs seconds of imports)
                _bf16_check(rank, world)
                _training_step_gradients(model, rank, world)
    finally:
        dist.destroy_process_group()


def _training_step_gradients(model: MegalodonLM, rank: int, world: int) -> None:
    """The loss CausalLM's training step back-propagates under chunk parallelism (``_chunk_parallel_loss``),
    its gradients averaged over the ranks as DDP / FSDP2 average them: every parameter's gradient equals that of
    the single-process mean loss over the whole batch (float64). The logged training losses cannot tell:
    AdamW's step barely moves when every gradient is scaled by the same factor."""
    from mega_suite.training.module import CausalLM

    module = CausalLM(MegalodonConfig(**CFG), optim={}, trainer={}, total_steps=1)
    module.model = model.train()
    batch = _packed_batch(2, 8 * world, seed=5)
    model.zero_grad(set_to_none=True)
    hidden, _ = model.forward_hidden(batch["input"])
    (model.token_nll(hidden, batch["target"]).sum() / batch["target"].numel()).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    module.chunk_parallel = ChunkParallelContext.from_group(None)
    module.on_train_batch_start(batch, 0)  # attaches the chunk-parallel exchange, as in training
    loss, nll, count = module._chunk_parallel_loss(batch, module.chunk_parallel)
    loss.backward()
    module.on_train_batch_end(None, batch, 0)
    assert int(count) == batch["target"].numel() // world  # this rank's slice
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)  # DDP / FSDP2: the mean over the ranks
        p.grad /= world
        assert _rel(p.grad, want[name]) <= 1e-10, (
            f"rank {rank}: training-step grad {name} off by {_rel(p.grad, want[name])}"
        )


def _eval_document(model: MegalodonLM, rank: int, world: int) -> None:
    """One document of 37 tokens split unevenly across the ranks (world 4: the last slice is 1 token) gives
    the NLL of the single-rank streaming pass."""
    model.eval()
    doc = _packed_batch(1, 37, seed=2)
    with torch.no_grad():
        hidden, _ = model.forward_hidden(doc["input"], use_cache=True)
        ref = model.token_nll(hidden, doc["target"]).sum()
        bounds = slice_bounds(37, world, CFG["chunk_size"], even=False)
        start, stop = bounds[rank]
        for mode in ("parallel", "sequential"):
            cp = ChunkParallelContext.from_group(None, mode=mode, lengths=[b - a for a, b in bounds])
            with cp.attached(model):
                hidden, _ = model.forward_hidden(doc["input"][:, start:stop])
            nll = model.token_nll(hidden, doc["target"][:, start:stop]).sum()
            dist.all_reduce(nll)
            assert _rel(nll, ref) <= 1e-10, f"rank {rank}/{world} {mode}: eval NLL {nll} vs stream {ref}"


def _validation_step(model: MegalodonLM, rank: int, world: int) -> None:
    """CausalLM.validation_step under chunk parallelism: the ranks of a group read the same [B, L] batch and
    each scores its slice, so the NLL, token and word totals summed over the ranks are the single-process
    ones, each token counted once (L a multiple of P·C, and not: 37 tokens split unevenly)."""
    from mega_suite.training.module import CausalLM

    module = CausalLM(MegalodonConfig(**CFG), optim={}, trainer={}, total_steps=1)
    module.model = model.eval()
    for length in (8 * world, 37):
        batch = _packed_batch(2, length, seed=4)
        batch["target"] = batch["target"].clone()  # a view of the same stream as the input
        batch["target"][0, 3] = -100
        batch["words"] = torch.tensor([5, 6])
        with torch.no_grad():
            hidden, _ = model.forward_hidden(batch["input"])
            ref = model.token_nll(hidden, batch["target"]).sum()
            module.chunk_parallel = None
            module._totals.clear()
            module.validation_step(batch, 0)
            assert module._totals[0][0] == pytest.approx(float(ref), rel=1e-12)  # the oracle agrees
            module.chunk_parallel = ChunkParallelContext.from_group(None)
            module._totals.clear()
            module.validation_step(batch, 0)
        nll, tokens, _, words = module._totals[0]
        total = torch.tensor([nll, tokens, words or 0], dtype=torch.float64)
        dist.all_reduce(total)
        where = f"rank {rank}/{world} validation_step L={length}"
        assert _rel(total[0], ref) <= 1e-10, f"{where}: NLL sum {float(total[0])} vs {float(ref)}"
        assert total[1:].tolist() == [2 * length - 1, 11], f"{where}: tokens, words {total[1:].tolist()}"
    assert not any(is_attached(m) for m in model.modules())
    assert {type(m).__name__ for m in model.modules()} >= {"TimestepNorm", "ComplexEMA"}


def _padded_layers(model: MegalodonLM, rank: int, world: int) -> None:
    """With a padding mask (padded steps leave the norm state unchanged, CEMA still decays over them) the
    sliced TimestepNorm and CEMA give the full pass's outputs and input gradients."""
    layer = model.layers[0].mega
    g = torch.Generator().manual_seed(3)
    length = 4 * world
    x = (torch.randn(2, length, 16, generator=g, dtype=torch.float64) * 2 + 5).requires_grad_()
    pad = torch.rand(2, length, generator=g) < 0.3
    pad[1, : length // 2 + 1] = True  # row 1: whole early slices are padding
    cot = torch.randn(2, length, 16, generator=g, dtype=torch.float64)

    def run(xs, mask):
        y, _ = layer.timenorm(xs, padding_mask=mask)
        z, _ = layer.cema(y, padding_mask=mask)
        return z

    ref = run(x, pad)
    (ref_gx,) = torch.autograd.grad((ref * cot).sum(), x)
    start, stop = slice_bounds(length, world, CFG["chunk_size"])[rank]
    xs = x.detach()[:, start:stop].requires_grad_()
    for mode in ("parallel", "sequential"):
        cp = ChunkParallelContext.from_group(None, mode=mode)
        with cp.attached(model):
            out = run(xs, pad[:, start:stop])
            (gx,) = torch.autograd.grad((out * cot[:, start:stop]).sum(), xs)
        assert _rel(out, ref[:, start:stop]) <= 1e-10, f"rank {rank}/{world} {mode}: padded output"
        assert _rel(gx, ref_gx[:, start:stop]) <= 1e-10, f"rank {rank}/{world} {mode}: padded input gradient"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_float64_equals_full_pass(world):
    """Training step (both modes) and the split-document evaluation equal the single-process passes; world 2
    also checks bf16-mixed with activation checkpointing (``_bf16_check``), world 4 the Lightning
    validation step."""
    spawn(_train_worker, world, world, free_port(), "float64")


def _fsdp_worker(rank: int, world: int, port: int, cp_size: int, ref_path: str) -> None:
    """(world / cp_size) data-parallel x cp_size chunk-parallel ranks, FSDP2 over all of them."""
    from torch.distributed.tensor import DTensor

    from mega_suite.distributed.fsdp import apply_fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        groups = [dist.new_group(list(range(s, s + cp_size))) for s in range(0, world, cp_size)]
        row, cp_rank = divmod(rank, cp_size)
        model = _model(torch.float32)
        model.gradient_checkpointing = True  # the recomputation in backward runs the exchanges again
        apply_fsdp(model)
        batch = _packed_batch(world // cp_size, 8 * cp_size, seed=1)
        mine = slice_batch(
            {k: v[row : row + 1] for k, v in batch.items()}, cp_rank, cp_size, CFG["chunk_size"]
        )
        for mode in ("parallel", "sequential"):
            model.zero_grad(set_to_none=True)
            cp = ChunkParallelContext.from_group(groups[row], mode=mode)
            assert (cp.rank, cp.world) == (cp_rank, cp_size)
            with cp.attached(model):
                logits, _ = model(mine["input"])  # through __call__: FSDP2's root hooks gather the embedding
                nll = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), mine["target"].flatten(), reduction="sum"
                )
                # FSDP averages over all ranks; x P makes that the mean over the data-parallel sequences.
                (global_mean_loss(nll, torch.tensor(mine["target"].numel()), cp) * cp_size).backward()
            ref = torch.load(ref_path, weights_only=True)
            for name, p in model.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                err = _rel(g, ref[name])
                assert err <= 1e-4, f"rank {rank} {mode} FSDP2 x chunk-parallel: grad {name} off by {err}"
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_data_x_chunk_parallel_equals_full_pass(tmp_path):
    """2 data x 2 chunk ranks = 4 processes, FSDP2 over the flattened 4, float32, activation checkpointing:
    the gradients of the single-process full batch, both modes."""
    model = _model(torch.float32)
    batch = _packed_batch(2, 16, seed=1)
    hidden, _ = model.forward_hidden(batch["input"])
    (model.token_nll(hidden, batch["target"]).mean()).backward()
    ref_path = tmp_path / "grads.pt"
    torch.save({n: p.grad for n, p in model.named_parameters()}, ref_path)
    spawn(_fsdp_worker, 4, 4, free_port(), 2, str(ref_path))


# ------------------------------------------------------------------ single-process pieces, against oracles


def test_slice_stats_merge_to_the_statistics_of_the_concatenation():
    from kernels.timestep_norm import merge_norm_states

    torch.manual_seed(0)
    x = torch.randn(2, 11, 8, dtype=torch.float64) * 3 + 50
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, 2:5] = True
    a = slice_norm_stats(x[:, :4], 2, pad[:, :4])
    b = slice_norm_stats(x[:, 4:], 2, pad[:, 4:])
    n, m, v = merge_norm_states(a, b)
    xg = x.view(2, 11, 2, 4)
    for row in range(2):
        keep = xg[row][~pad[row]]  # [valid steps, G, 4]
        assert n[row] == keep.shape[0]
        for grp in range(2):
            vals = keep[:, grp].flatten()
            assert torch.allclose(m[row, grp], vals.mean(), rtol=1e-13)
            assert torch.allclose(v[row, grp], vals.var(unbiased=False), rtol=1e-12)


def test_h0_term_matches_direct_powers():
    torch.manual_seed(0)
    d, n, length = 3, 4, 23
    q = torch.polar(
        torch.rand(d, n, dtype=torch.float64) * 0.5 + 0.45, torch.rand(d, n, dtype=torch.float64) * 6
    )
    c = torch.randn(2, d, n, dtype=torch.complex128)
    got = _h0_term(c, torch.log(q), length)  # [B, L, D]
    t = torch.arange(length, dtype=torch.float64)
    want = (c[:, None] * q[None, None] ** t.view(1, -1, 1, 1).to(torch.complex128)).real.sum(-1)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-13)


def test_slice_bounds_reject_unaligned_lengths():
    assert slice_bounds(16, 2, 4) == [(0, 8), (8, 16)]
    assert slice_bounds(37, 3, 4, even=False) == [(0, 16), (16, 32), (32, 37)]
    with pytest.raises(ValueError, match="multiple of chunk_parallel"):
        slice_bounds(20, 2, 4)
    with pytest.raises(ValueError, match="cannot give each"):
        slice_bounds(9, 4, 4, even=False)


def test_context_rejects_bad_settings():
    with pytest.raises(ValueError, match="mode must be one of"):
        ChunkParallelContext(None, 0, 2, mode="pipeline")
    with pytest.raises(ValueError, match="outside the group"):
        ChunkParallelContext(None, 2, 2)
    cp = ChunkParallelContext(None, 1, 2, lengths=(8, 5))
    assert cp.offset(5) == 8
    with pytest.raises(ValueError, match="got a slice of 4 tokens, its context says 5"):
        cp.offset(4)


# ------------------------------------------------------------------ bf16-mixed


def _bf16_check(rank: int, world: int) -> None:
    """bf16 autocast (docs/architecture.md#the-block: CEMA and the norms are float32 islands) with activation checkpointing: the
    exchanged states are float32, and the chunk-parallel loss and gradients are as close to the float64 full
    pass as the single-process bf16-mixed full pass is (test_precision.py's rule: <= 2 x its error + atol)."""
    from mega_suite.distributed.chunk_parallel import ChunkParallelContext as Ctx

    sent: list[torch.dtype] = []
    gather, send = Ctx._gather_plain, Ctx._send

    def spy_gather(self, t):
        sent.append(t.dtype)
        return gather(self, t)

    def spy_send(self, t, dst, tag):
        sent.append(t.dtype)
        return send(self, t, dst, tag)

    Ctx._gather_plain, Ctx._send = spy_gather, spy_send  # this spawned process only
    try:
        batch = _packed_batch(2, 8 * world, seed=1)
        ref_loss, _, ref_grads, _ = _step(_plain_model(torch.float64), batch)
        model = _plain_model(torch.float32)
        model.gradient_checkpointing = True
        with torch.autocast("cpu", torch.bfloat16):
            base = _bf16_errors(*_step(model, batch)[::2], ref_loss, ref_grads)
            mine = slice_batch(batch, rank, world, CFG["chunk_size"])
            for mode in ("parallel", "sequential"):
                sent.clear()
                cp = ChunkParallelContext.from_group(None, mode=mode)
                got = _bf16_errors(*_step(model, mine, cp)[::2], ref_loss, ref_grads)
                where = f"rank {rank}/{world} {mode} bf16-mixed"
                # counts are int64 (the count all-gather only runs with a padding mask)
                states = [d for d in sent if d != torch.int64]
                assert states and set(states) == {torch.float32}, f"{where}: states exchanged as {set(sent)}"
                bad = {n: (got[n], base[n]) for n in got if got[n] > 2 * base[n] + 1e-3}
                assert not bad, f"{where}: error vs float64 above 2 x single-process bf16 + 1e-3: {bad}"
    finally:
        Ctx._gather_plain, Ctx._send = gather, send


def _plain_model(dtype: torch.dtype) -> MegalodonLM:
    """Default initialisation: ``_model``'s +3 norm biases leave bf16 gradients ~50% off even unsplit, too
    loose a yardstick (here ~1%)."""
    torch.manual_seed(0)
    return MegalodonLM(MegalodonConfig(**CFG)).to(dtype)


def _bf16_errors(loss, grads, ref_loss, ref_grads) -> dict[str, float]:
    err = {"loss": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))}
    for name, g in ref_grads.items():
        err[name] = float((grads[name].double() - g).norm() / g.norm().clamp(min=1e-30))
    return err


def test_eval_context_split_across_two_ranks_equals_streaming():
    """mode=eval_context with trainer.chunk_parallel=2: every window split across 2 spawned ranks gives the
    single-rank streaming rows (float64); a window too short to split (4 tokens) is streamed by rank 0."""
    from mega_suite.evaluation.context import eval_context, eval_context_chunk_parallel

    model = _model(torch.float64)
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(1, CFG["vocab_size"], (n,), generator=g) for n in (38, 5, 61)]
    lengths = [16, 64]
    want = eval_context(model, docs, lengths, num_words=50, progress=False)
    got = eval_context_chunk_parallel(model, docs, lengths, 2, num_words=50, progress=False)
    for w, g_ in zip(want, got, strict=True):
        assert g_["tokens"] == w["tokens"] == 37 + 4 + 60
        assert g_["nll"] == pytest.approx(w["nll"], rel=1e-10), (g_, w)
        assert g_["word_ppl"] == pytest.approx(w["word_ppl"], rel=1e-10)


@pytest.mark.slow
def test_run_eval_context_with_chunk_parallel_2(tmp_path, capfd):
    """runner.run_eval_context with trainer.chunk_parallel=2 (a meta-initialised model, as strategy=fsdp
    builds it): the rows of the single-rank streaming pass over the same documents and weights."""
    from types import SimpleNamespace

    from modality_fixtures import write_pg19
    from omegaconf import OmegaConf

    from datamodules.pg19 import PG19DataModule
    from mega_suite.training.module import CausalLM
    from mega_suite.training.runner import run_eval_context

    write_pg19(tmp_path)
    dm = PG19DataModule(str(tmp_path), batch_size=2, seq_len=32, eval_seq_len=24, vocab_size=320)
    dm.prepare_data()
    cfg = {**CFG, "vocab_size": dm.vocab_size}
    rows = {}
    for p in (1, 2):
        module = CausalLM(MegalodonConfig(**cfg), optim={}, trainer={}, total_steps=1, meta_init=True,
                          init_seed=7)  # fmt: skip
        conf = OmegaConf.create(dict(
            ckpt=None, eval_max_documents=1, eval_context_lengths=[16, 1000],
            trainer=dict(accelerator="cpu", chunk_parallel=p, chunk_parallel_mode="parallel"),
        ))  # fmt: skip
        out = tmp_path / f"p{p}"
        run_eval_context(conf, module, dm, SimpleNamespace(logger=None), out)
        assert ("(2 chunk-parallel ranks)" in capfd.readouterr().out) == (p == 2)  # the split ran
        table = (out / "eval_context.md").read_text().splitlines()[-2:]
        rows[p] = [[float(v) for v in line.strip("|").split("|")[:4]] for line in table]
    for one, two in zip(rows[1], rows[2], strict=True):  # context, tokens scored, token ppl, word ppl
        assert two[:2] == one[:2]
        assert two[2:] == pytest.approx(one[2:], rel=1e-5)


def test_attaching_swaps_only_the_full_pass_of_the_causal_layers():
    """Attached, a causal TimestepNorm / CEMA is a chunk-parallel subclass (still a float32 island) whose full
    pass is the rank's slice; a stream with a fresh cache (CEMA state None, returned) never takes that path,
    so its logits are the detached model's; detaching restores the classes. The slice path is reached only
    through the context (a planted object with no methods would raise there)."""
    torch.manual_seed(0)
    model = MegalodonLM(MegalodonConfig(**CFG)).double().eval()
    tokens = torch.randint(0, CFG["vocab_size"], (2, 11))
    with torch.no_grad():
        want, _ = model(tokens, use_cache=True)
        modules = attach(model, object())
        assert modules and all(
            is_attached(m) and type(m).__name__.startswith("ChunkParallel") for m in modules
        )
        assert all(getattr(m, "float32_island", False) for m in modules)
        assert all(lc.cema is None for lc in model.new_cache(2).layers)
        got, _ = model(tokens, use_cache=True)
        with pytest.raises(AttributeError):
            model(tokens)  # the full pass asks the (planted) context for the slice
        attach(model, None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not any(is_attached(m) for m in model.modules())
    assert {type(m).__name__ for m in modules} == {"TimestepNorm", "ComplexEMA"}
