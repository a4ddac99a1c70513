"""``mode=plan``: the memory a run needs per GPU and per host process, before renting the GPUs.

Nothing is allocated at full size: the model is built on the meta device (parameter counts and the largest
FSDP unit come from it). Per GPU, with P parameters (float32 master weights), shard size S (fsdp: every rank;
hsdp: the devices of a node; ddp / one device: 1):

- parameters P·4/S, gradients P·4/S (float32, reduce-scattered), AdamW state 2·P·4/S;
- under FSDP the gathered (unsharded) parameters of the running and the prefetched unit: 2·U·b, U the
  largest unit's parameter count, b = 2 bytes under bf16-mixed (4 otherwise);
- activations: **measured**, not guessed. One- and two-layer models of the same architecture and heads run
  one forward on CPU over one attention context (the chunk, or the window);
  walking the autograd graph counts the bytes it stores for backward (``mega_suite.tools.memory``; parameters
  and tensors rebuilt in backward excluded); two layers minus one = bytes per token per layer. Measured at (width/16, context/16),
  (width/8, context/16) and (width/16, context/8) (widths: model_dim, z_dim, value_dim, ffn_hidden_dim),
  fitted as a + b·D + g·c (chunked attention keeps h·c scores per token) and evaluated at the recipe's
  width and context. Times layers and tokens per micro-batch; the language model's logits add tokens·V·4·2
  (float32 logits and their softmax gradient).
  With activation checkpointing each block keeps only its input (tokens·D·4) plus one block's activations
  while it is recomputed.

Host RAM per rank at start-up (meta build): its parameter shard plus one FSDP unit whole while it is
initialised (``parallel.init_sharded``); with ``init_from=`` rank 0 also reads the whole file (P·4).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from omegaconf import DictConfig

from mega_suite.config.run_plan import RunPlan, make_plan
from mega_suite.models import build_model, build_on_meta, count_parameters
from mega_suite.models.megalodon.lean import is_rebuilt
from mega_suite.tools.memory import stored_for_backward

GIB = 1024**3
_WIDTHS = ("model_dim", "z_dim", "value_dim", "ffn_hidden_dim")


def _shard_size(cfg: DictConfig, world: int) -> int:
    s = cfg.trainer.strategy
    if s == "fsdp":
        return world
    if s == "hsdp":
        return max(1, world // cfg.trainer.num_nodes)
    return 1


def _context_field(mcfg) -> str | None:
    """The config field bounding how many tokens one token attends to: the chunk (Megalodon) or the window."""
    for name in ("chunk_size", "max_seq_len"):
        if getattr(mcfg, name, None):
            return name
    return None


def _scaled(mcfg, divisor: int, layers: int, context: int | None = None):
    changes: dict[str, Any] = {"num_layers": layers}
    heads = getattr(mcfg, "num_heads", 1) or 1
    for name in _WIDTHS:
        value = getattr(mcfg, name, None)
        if value:
            step = heads * getattr(mcfg, "norm_num_groups", 1) if name == "model_dim" else heads
            step = math.lcm(step, 2 * heads)
            changes[name] = max(step, (value // divisor) // step * step)
    field = _context_field(mcfg)
    if context is not None and field:
        changes[field] = context
    return dataclasses.replace(mcfg, **changes)


def _inputs(mcfg, length: int):
    kind = getattr(mcfg, "input_type", "token")
    if kind == "scalar":
        return (torch.randn(1, length),)
    if kind == "patch":
        return (torch.randn(1, mcfg.in_chans, mcfg.image_size, mcfg.image_size),)
    x = torch.randint(0, mcfg.vocab_size, (1, length))
    return (x, None, x, None) if getattr(mcfg, "dual_input", False) else (x,)


def saved_bytes(mcfg, length: int, bf16: bool) -> int:
    """Bytes autograd stores for backward in one forward of ``build_model(mcfg)`` (parameters excluded),
    found by walking the graph: tensors a model's own saved-tensor hooks rebuild in backward do not count,
    and those saved inside such hooks do (a counting hook around the forward would see neither)."""

    torch.manual_seed(0)
    model = build_model(mcfg)
    inputs = _inputs(mcfg, length or getattr(mcfg, "image_size", 1) ** 2)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    with ctx:
        if hasattr(model, "forward_hidden") and not getattr(mcfg, "num_classes", 0):
            out = model.forward_hidden(inputs[0])
        else:
            out = model(*inputs)
    outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn]
    return sum(stored_for_backward(outs, exclude=list(model.parameters()), rebuilt=is_rebuilt).values())


def activation_bytes_per_token_layer(mcfg, context: int, bf16: bool, patch: bool) -> tuple[float, str]:
    """Bytes saved per token per layer at the full width D and attention context c (the chunk, the window),
    modelled as a + b·D + g·c (chunked attention keeps h·c scores per token) and fitted on 1- and 2-layer
    runs at (D/16, c/16), (D/8, c/16), (D/16, c/8) -- sequence = one context, so each run is small.
    Megalodon's ``recompute_linears=auto`` is decided for the full model at c and kept in the small runs."""
    note = ""
    if hasattr(mcfg, "rebuilds_linears"):
        decided = "always" if mcfg.rebuilds_linears(context or mcfg.chunk_size) else "never"
        note = f"model.recompute_linears={mcfg.recompute_linears}: {'on' if decided == 'always' else 'off'}; "
        mcfg = dataclasses.replace(mcfg, recompute_linears=decided)

    def per_layer(divisor: int, ctx: int | None, length: int) -> tuple[int, float]:
        one = saved_bytes(_scaled(mcfg, divisor, 1, ctx), length, bf16)
        two = saved_bytes(_scaled(mcfg, divisor, 2, ctx), length, bf16)
        tokens = length or (mcfg.image_size // mcfg.patch_size) ** 2
        return _scaled(mcfg, divisor, 1).model_dim, (two - one) / tokens

    # the two widths must differ: small models are divided less
    coarse, fine = next(
        ((a, b) for a, b in ((16, 8), (8, 4), (4, 2), (2, 1))
         if _scaled(mcfg, a, 1).model_dim < _scaled(mcfg, b, 1).model_dim),
        (2, 1),
    )  # fmt: skip
    if patch:  # the image fixes the sequence: scale the width only
        (w1, b1), (w2, b2) = per_layer(coarse, None, 0), per_layer(fine, None, 0)
        full = b2 + (b2 - b1) / (w2 - w1) * (mcfg.model_dim - w2)
        return full, note + f"{b1:.0f} B at D={w1}, {b2:.0f} B at D={w2}, linear in D to D={mcfg.model_dim}"
    c1, c2 = max(8, context // 16), max(16, context // 8)
    (w1, b11), (w2, b21) = per_layer(coarse, c1, c1), per_layer(fine, c1, c1)
    b12 = per_layer(coarse, c2, c2)[1]
    # a negative context slope (measured on some small configs: the CEMA FFT length rounds up) is not
    # extrapolated: per-token memory does not shrink with a longer context
    slope_d, slope_c = (b21 - b11) / (w2 - w1), max(0.0, (b12 - b11) / (c2 - c1))
    full = b11 + slope_d * (mcfg.model_dim - w1) + slope_c * (context - c1)
    full = max(full, b21)
    how = note + (
        f"{b11:.0f} B at (D={w1}, c={c1}), {b21:.0f} B at (D={w2}, c={c1}), {b12:.0f} B at (D={w1}, c={c2}); "
        f"a + b*D + g*c (g >= 0) gives {full:.0f} B at (D={mcfg.model_dim}, c={context})"
    )
    return full, how


def plan(cfg: DictConfig) -> str:
    """The table of a configuration ``load_config`` validated."""
    return plan_table(make_plan(cfg))


def plan_table(run: RunPlan) -> str:
    """``mode=plan``: the memory table of a run plan (read, never changed)."""
    cfg = run.cfg
    mcfg = run.model
    model = build_on_meta(mcfg)
    total = count_parameters(model)
    unit = max((sum(p.numel() for p in u.parameters()) for u in model.fsdp_units()), default=0)
    root = total - sum(sum(p.numel() for p in u.parameters()) for u in model.fsdp_units())
    unit = max(unit, root)
    devices, nodes, world = run.devices, run.nodes, run.world
    shard = _shard_size(cfg, world)
    bf16 = str(cfg.trainer.precision).startswith("bf16")
    sharded = run.sharded

    lm = cfg.task == "lm"
    if lm:
        seq = run.seq_len or round(run.tokens_per_sequence) or getattr(mcfg, "max_seq_len", 0)
    else:
        seq = int(cfg.data.max_length or 0) or int(_default_length(cfg) or 0)
        if getattr(mcfg, "input_type", "token") == "patch":
            seq = (mcfg.image_size // mcfg.patch_size) ** 2
    batch = int(cfg.data.batch_size)
    tokens_micro = batch * seq
    field = _context_field(mcfg)
    context = min(seq, getattr(mcfg, field)) if field else seq
    patch = getattr(mcfg, "input_type", "token") == "patch"
    per_token_layer, how = activation_bytes_per_token_layer(mcfg, context, bf16, patch)
    layers = mcfg.num_layers
    logits = tokens_micro * mcfg.vocab_size * 4 * 2 if lm else 0
    act = per_token_layer * layers * tokens_micro + logits
    act_ckpt = tokens_micro * mcfg.model_dim * 4 * layers + per_token_layer * tokens_micro + logits

    accumulate = run.accumulate_grad_batches
    gathered = 2 * unit * (2 if bf16 else 4) if sharded else 0
    rows = [
        ("parameters (float32, sharded)", total * 4 / shard),
        ("gradients (float32, sharded)", total * 4 / shard),
        ("AdamW state (2 x float32, sharded)", 2 * total * 4 / shard),
        ("gathered units (running + prefetched)", gathered),
        ("activations, no checkpointing", act),
        ("activations, activation checkpointing", act_ckpt),
    ]
    states = sum(v for _, v in rows[:4])
    ckpt_on = bool(cfg.trainer.gradient_checkpointing)
    lines = [
        f"plan: recipe={cfg.recipe}  {type(model).__name__} {total / 1e6:,.1f}M parameters  "
        f"strategy={cfg.trainer.strategy}  {nodes} node(s) x {devices} device(s) = {world} ranks, "
        f"parameters sharded over {shard}  precision={cfg.trainer.precision}",
        f"micro-batch {batch} x {seq} {'tokens' if lm else 'steps'}; accumulation {accumulate}; "
        + (f"tokens per optimizer step {tokens_micro * world * accumulate:,}" if lm
           else f"samples per optimizer step {batch * world * accumulate:,}"),
        "",
        f"{'per GPU':42s} {'GiB':>10s}",
    ]  # fmt: skip
    lines += [f"  {name:40s} {value / GIB:10.2f}" for name, value in rows]
    for label, a, on in (
        ("total, no checkpointing", act, False),
        ("total, activation checkpointing", act_ckpt, True),
    ):
        mark = (
            f"  <- the recipe's trainer.gradient_checkpointing={str(ckpt_on).lower()}"
            if on == ckpt_on
            else ""
        )
        lines.append(f"  {label:40s} {(states + a) / GIB:10.2f}{mark}")
    host = total * 4 / shard + (unit * 4 if sharded else 0)
    host_full = total * 4
    lines += [
        "",
        f"host RAM per rank at start-up: {(host if sharded else host_full) / GIB:.2f} GiB "
        + ("(meta build: its shard + one FSDP unit whole while initialised)" if sharded
           else "(the whole model is built on every rank: use trainer.strategy=fsdp to shard it)")
        + f"; with init_from= rank 0 also reads the whole file ({host_full / GIB:.2f} GiB)",
        f"activations: saved-for-backward bytes per token per layer measured on CPU (autograd graph walk, "
        f"2 layers minus 1): {how}; x {layers} layers x {tokens_micro:,} tokens"
        + (f"; + logits {tokens_micro:,} x V={mcfg.vocab_size} x 4 B x 2" if lm else "")
        + ". Fused GPU attention kernels save less than this CPU reference path (an upper bound).",
    ]  # fmt: skip
    return "\n".join(lines)


def _default_length(cfg: DictConfig) -> int | None:
    from mega_suite.config.resolve import data_contract, data_module

    contract = data_contract(cfg)
    if contract.default_max_length:
        return contract.default_max_length
    cls, _ = data_module(cfg)
    import sys

    return getattr(sys.modules[cls.__module__], "CLIP_SAMPLES", None)  # fixed-length data (speech clips)
