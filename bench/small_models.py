"""Small models at speed: training tokens/s of the `pg19_small` and `debug` sizes, a baseline checkout side by side.

    python -m bench.small_models                                   # this checkout, fp32 and bf16-mixed
    python -m bench.small_models --baseline /tmp/base439 --rounds 3   # + an older checkout, alternating
    python -m bench.small_models --compile                         # + torch.compile (Inductor) of each block, as ``trainer.compile=true``
    python -m bench.small_models --malloc system,tcmalloc          # each variant under both allocators
    python -m bench.small_models --compile --inductor-defaults     # compiled with and without the suite's CPU options
    python -m bench.small_models --profile pg19_small              # only: profiler table of one step

Models (the recipes' model sections, built with ``create_model``):

- ``pg19_small``: the LM of ``recipe=pg19_small`` (4 layers, D 128, Z 64, E 256, FFN 256, C 512, tied 4000-token
  vocabulary, 1.44M parameters), batch 1 x 2048 tokens, cross-entropy on next tokens;
- ``debug``: the classifier of ``recipe=debug`` (2 layers, D 32, C 128, 10 classes, ListOps vocabulary),
  batch 8 x 2000 tokens, cross-entropy on the class.

A step is forward, loss, backward, AdamW step (with the kernels the checkout's suite picks: fused since
``optim.implementation``, torch's CPU default for-loop before), gradients to None, in train mode (dropout
on). tokens/s = batch
tokens / median step time over ``--steps`` steps after two warm-up steps (``--compile``: after the compile,
whose wall time is printed). Every (checkout, variant) runs in a fresh process with ``--threads`` threads;
rounds alternate checkouts so the machine's load drifts over both alike: compare ratios within a round.
``--malloc``: the allocators each variant of this checkout runs under (``system``: glibc's malloc;
``tcmalloc`` / ``jemalloc``: preloaded as ``run.py`` does, ``mega_suite.tools.malloc``; one not installed is left
out with a note); the baseline runs under glibc's, as when the issue was written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import machine_description, markdown_table
from bench.cpu_bar import matmul_peak_gflops
from mega_suite.tools import malloc

ROOT = Path(__file__).resolve().parents[1]

MODELS = {
    "pg19_small": dict(
        preset="megalodon_debug",
        overrides=dict(
            num_layers=4, model_dim=128, num_heads=1, z_dim=64, value_dim=256, ffn_hidden_dim=256, cema_ndim=16,
            norm_num_groups=16, chunk_size=512, scale_emb=True, share_emb=True, vocab_size=4000,
        ),
        batch=1, length=2048, kind="lm",
    ),
    "debug": dict(
        preset="lra_listops",
        overrides=dict(
            num_layers=2, model_dim=32, z_dim=16, value_dim=32, ffn_hidden_dim=32, norm_num_groups=4, cema_ndim=4,
            chunk_size=128,
        ),
        batch=8, length=2000, kind="classify",
    ),
}  # fmt: skip

# Runs in a fresh interpreter with PYTHONPATH = the checkout under test; prints one JSON line.
WORKER = r"""
import json, statistics, sys, time
import torch
import torch.nn.functional as F
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
torch.manual_seed(0)
try:
    from mega_suite.models import create_model
except ImportError:  # checkouts before the model registry
    from mega_suite.presets import create_model
spec = args["model"]
model = create_model(spec["preset"], **spec["overrides"]).train()
try:  # AdamW's kernels as the checkout's suite picks them (optim.implementation; for-loop before the key)
    try:
        from mega_suite.config import ADAMW_KERNELS, OptimSection
    except ImportError:  # checkouts before the config package
        from mega_suite.settings import ADAMW_KERNELS, OptimSection
    kernels = ADAMW_KERNELS[OptimSection().implementation]
except ImportError:
    kernels = dict(foreach=False)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kernels)
b, n = spec["batch"], spec["length"]
if spec["kind"] == "lm":
    x = torch.randint(0, spec["overrides"]["vocab_size"], (b, n + 1))
    inputs, target = x[:, :-1], x[:, 1:]
else:
    inputs, target = torch.randint(1, 15, (b, n)), torch.randint(0, 10, (b,))
net = model
compile_s = None
if args["compile"]:  # as trainer.compile does: each block in place (one compiled graph shared by the blocks)
    try:  # and with the checkout's Inductor options on the CPU (older checkouts: settings, or none)
        from mega_suite.training.module import CPU_INDUCTOR_OPTIONS
    except ImportError:
        try:
            from mega_suite.settings import CPU_INDUCTOR_OPTIONS
        except ImportError:
            CPU_INDUCTOR_OPTIONS = {}
    if args.get("inductor_defaults"):
        CPU_INDUCTOR_OPTIONS = {}
    for unit in model.compile_units() if hasattr(model, "compile_units") else list(model.layers):
        unit.compile(options=CPU_INDUCTOR_OPTIONS) if CPU_INDUCTOR_OPTIONS else unit.compile()
bf16 = args["precision"] == "bf16-mixed"

def step():
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        out = net(inputs)
        logits = out[0] if isinstance(out, tuple) else out
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

t0 = time.perf_counter()
step()
if args["compile"]:
    compile_s = time.perf_counter() - t0
step()
times = []
for _ in range(args["steps"]):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
if args["profile"]:
    from torch.profiler import profile
    with profile() as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args["profile"]), file=sys.stderr)
params = sum(p.numel() for p in model.parameters())
print(json.dumps(dict(step_s=statistics.median(times), tokens=b * n, params=params, compile_s=compile_s)))
"""


def run_one(
    checkout: Path, model: str, precision: str, compile_: bool, steps: int, threads: int, profile: int = 0,
    lib: Path | None = None, inductor_defaults: bool = False,
):  # fmt: skip
    """One (checkout, variant) in a fresh process; ``lib``: an allocator to preload (None: glibc's);
    ``inductor_defaults``: compile with Inductor's default options, not the suite's CPU ones."""
    args = dict(model=MODELS[model], precision=precision, compile=compile_, steps=steps, threads=threads)
    args["inductor_defaults"] = inductor_defaults
    args["profile"] = profile
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", malloc.MARK)}
    env.update(PYTHONPATH=str(checkout), OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    if lib is not None:
        env = malloc.restart_env(env, lib)
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        cwd=checkout,
    )
    if profile:
        print(proc.stderr[-20000:])
    if proc.returncode != 0:
        return dict(
            error=proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="an older checkout of mega-suite, run side by side")
    ap.add_argument("--models", default="pg19_small,debug")
    ap.add_argument("--precisions", default="32-true,bf16-mixed")
    ap.add_argument("--compile", action="store_true", help="also torch.compile (Inductor) the model")
    ap.add_argument(
        "--inductor-defaults", action="store_true",
        help="with --compile: also each compiled variant with Inductor's default options instead of the "
        "suite's (training.module.CPU_INDUCTOR_OPTIONS), side by side",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--malloc", default="system", help="comma list of system, tcmalloc, jemalloc")
    ap.add_argument(
        "--profile", metavar="MODEL", help="only: profile one step of MODEL (fp32, this checkout)"
    )
    a = ap.parse_args()
    if a.baseline is not None and not (a.baseline / "mega_suite").is_dir():
        sys.exit(f"--baseline {a.baseline}: not a mega-suite checkout (no mega_suite/ directory)")
    if a.profile:
        if a.profile not in MODELS:
            sys.exit(f"--profile {a.profile!r}: expected one of {sorted(MODELS)}")
        run_one(ROOT, a.profile, "32-true", False, 2, a.threads, profile=40)
        return
    models = [m for m in a.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            sys.exit(f"--models: unknown {m!r}; expected some of {sorted(MODELS)}")
    precisions = [p for p in a.precisions.split(",") if p]
    allocators = {}
    for name in [n for n in a.malloc.split(",") if n]:
        if name == "system":
            allocators[name] = None
        elif name not in malloc.LIBRARIES:
            sys.exit(f"--malloc: unknown {name!r}; expected some of system, {', '.join(malloc.LIBRARIES)}")
        elif (lib := malloc.find(name)) is None:
            print(f"--malloc {name}: not installed ({' / '.join(malloc.LIBRARIES[name])}), left out")
        else:
            allocators[name] = lib
    if not allocators:
        sys.exit("--malloc: none of the allocators asked for is installed")
    print(f"```\n{machine_description(a.threads)}\n```\n", flush=True)
    torch.set_num_threads(a.threads)
    peak = matmul_peak_gflops()
    print(
        f"fp32 matmul peak measured now: {peak:.0f} GFLOP/s (4096^3 torch.mm, {a.threads} threads)",
        flush=True,
    )
    variants = [(p, False) for p in precisions] + ([(p, True) for p in precisions] if a.compile else [])
    variants = [(p, c, name, False) for p, c in variants for name in allocators]
    if a.inductor_defaults:
        variants += [(p, True, name, True) for p, c, name, _ in variants if c]
    rows, base_tps = [], {}
    for r in range(1, a.rounds + 1):
        for m in models:
            if a.baseline is not None:
                res = run_one(a.baseline, m, "32-true", False, a.steps, a.threads)
                tps = res["tokens"] / res["step_s"] if "step_s" in res else None
                base_tps[m, r] = tps
                rows.append(_row(r, m, "baseline", "32-true", False, res, tps, None, "system"))
                print(f"  round {r} {m} baseline: {_fmt(tps)} tok/s", flush=True)
            for p, c, name, defaults in variants:
                res = run_one(
                    ROOT, m, p, c, a.steps, a.threads, lib=allocators[name], inductor_defaults=defaults
                )
                tps = res["tokens"] / res["step_s"] if "step_s" in res else None
                ref = base_tps.get((m, r))
                rows.append(
                    _row(r, m, "this", p, "Inductor defaults" if defaults else c, res, tps, ref, name)
                )
                label = f"{p}{' compiled' if c else ''}{' (Inductor defaults)' if defaults else ''}"
                label += "" if name == "system" else " " + name
                print(f"  round {r} {m} this {label}: {_fmt(tps)} tok/s", flush=True)
    header = [
        "round",
        "model",
        "checkout",
        "precision",
        "compile",
        "malloc",
        "step ms",
        "tokens/s",
        "x baseline",
        "compile s",
        "% fp32 peak",
    ]
    for row in rows:  # share of the fp32 matmul peak: the language model's analytic matmul FLOPs per token
        flops = lm_flops_per_token(row[1])
        row.append(
            f"{100 * flops * row[7] / (peak * 1e9):.0f}%" if flops and isinstance(row[7], int) else "-"
        )
    print()
    print(markdown_table(header, rows))
    if a.baseline is not None:  # per round the fastest variant of this checkout, then the median over rounds
        for m in models:
            best = []
            for r in range(1, a.rounds + 1):
                mine = [row[7] for row in rows if row[:3] == [r, m, "this"] and isinstance(row[7], int)]
                if mine and base_tps.get((m, r)):
                    best.append(max(mine) / base_tps[m, r])
            if best:
                print(f"{m}: best variant / baseline, median over rounds: {statistics.median(best):.2f}x")


def lm_flops_per_token(model: str) -> float | None:
    """Training matmul FLOPs per token of a language-model entry (``flops_per_token`` of its architecture)."""
    spec = MODELS[model]
    if spec["kind"] != "lm":
        return None
    from mega_suite.models import arch_of, get_config

    cfg = get_config(spec["preset"], **spec["overrides"])
    return arch_of(cfg).flops_per_token(cfg, spec["length"])


def _fmt(x):
    return "-" if x is None else f"{x:,.0f}"


def _row(r, m, checkout, p, c, res, tps, ref, alloc):
    head = [r, m, checkout, p, c if isinstance(c, str) else ("yes" if c else "no"), alloc]
    if "error" in res:
        return [*head, "error", res["error"][:60], "-", "-"]
    ratio = f"{tps / ref:.2f}x" if ref else "-"
    comp = f"{res['compile_s']:.0f}" if res.get("compile_s") else "-"
    return [*head, f"{res['step_s'] * 1000:.0f}", round(tps), ratio, comp]


if __name__ == "__main__":
    main()
