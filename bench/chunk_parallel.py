"""Chunk parallelism on CPU over gloo: step time, per-rank peak memory and bytes communicated, for 1, 2, 4
processes at a fixed total length (strong scaling) and a fixed length per rank (weak scaling), both modes.

Each configuration spawns its P processes afresh (one thread each). A step is forward + backward + the
gradient sum over the group; the time is the median of the timed steps on rank 0 (the slowest rank decides
the step, and every rank waits on the collectives). Memory: VmHWM over the steps - VmRSS after the model and
the batch are built (activations and gradients of a step, allocator slack), the max over ranks. Bytes: payload sent by one rank in a
step (forward and backward), all layers (2 exchanges per block + the final norm), and per block.
"Blocked" is the time the last rank spends inside blocking communication (receives, all-gathers,
all-reduces: mostly waiting for the other ranks), median over the timed steps. "CPU s" is the process CPU
time of a step (all threads), the max over ranks: the work, whatever the contention for the cores.

    PYTHONPATH=. .venv/bin/python bench/chunk_parallel.py --markdown

``--max-context GIB``: the longest context one training step fits in GIB of memory, for each P in
``--worlds`` (parallel mode). Per rank, memory = the process's resident base (runtime, model, optimizer-free
step) + activations linear in the tokens per rank; both are measured at ``--fit-lengths`` tokens per rank
(one timed step each), the activation slope and intercept fitted by least squares, and the longest total
length L solving P·(base + a + b·L/P) <= GIB (all P processes on one machine) and base + a + b·L/P <= GIB
(each rank on its own device of GIB) reported, rounded down to P·C. Extrapolated beyond the measured lengths.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODEL = dict(
    num_layers=4, model_dim=128, num_heads=2, z_dim=64, value_dim=256, ffn_hidden_dim=256, swiglu=True,
    cema_ndim=16, norm_num_groups=8, chunk_size=128, vocab_size=512,
)  # fmt: skip


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _worker(rank: int, world: int, port: int, mode: str, total: int, steps: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from mega_suite.distributed.chunk_parallel import (
        ChunkParallelContext,
        global_mean_loss,
        reduce_gradients,
        slice_batch,
    )
    from mega_suite.models.megalodon.config import MegalodonConfig
    from mega_suite.models.megalodon.lm import MegalodonLM

    torch.manual_seed(0)
    model = MegalodonLM(MegalodonConfig(**MODEL))
    seq = torch.randint(0, MODEL["vocab_size"], (1, total + 1))
    batch = slice_batch({"input": seq[:, :-1], "target": seq[:, 1:]}, rank, world, MODEL["chunk_size"])
    cp = ChunkParallelContext.from_group(None, mode=mode) if world > 1 else None

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if cp is None:
            hidden, _ = model.forward_hidden(batch["input"])
            (model.token_nll(hidden, batch["target"]).mean()).backward()
            return
        with cp.attached(model):
            hidden, _ = model.forward_hidden(batch["input"])
            nll = model.token_nll(hidden, batch["target"]).sum()
            global_mean_loss(nll, torch.tensor(batch["target"].numel()), cp).backward()
        reduce_gradients(model, cp)

    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak is that of the steps
    step()  # warm-up
    times, cpu, sent, blocked = [], [], [], []
    for _ in range(steps):
        if cp is not None:
            cp.stats.reset()
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if cp is not None:
            sent.append(cp.stats.bytes_sent)
            blocked.append(cp.stats.wait_s)
    peak = _status("VmHWM") - base
    med = statistics.median
    out.put((rank, med(times), peak, max(sent, default=0), med(blocked or [0.0]), med(cpu), base))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, mode: str, total: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_worker, (world, _free_port(), mode, total, steps, out), world, join=True,
                       start_method="spawn")  # fmt: skip
    rows = sorted(out.get() for _ in range(world))
    layers = MODEL["num_layers"]
    return dict(
        world=world, mode=mode if world > 1 else "-", total=total, per_rank=total // world,
        step_s=rows[0][1], peak_mib=max(r[2] for r in rows) / 2**20, sent_kib=rows[0][3] / 1024,
        per_block_kib=rows[0][3] / 1024 / layers, blocked_s=rows[-1][4], cpu_s=max(r[5] for r in rows),
        base_mib=max(r[6] for r in rows) / 2**20,
    )  # fmt: skip


def max_context(worlds: list[int], lengths: list[int], budget_gib: float, steps: int) -> list[dict]:
    """Measured points and the fitted longest context per P (see the module docstring)."""
    chunk, rows = MODEL["chunk_size"], []
    for world in worlds:
        points = [run(world, "parallel", n * world, steps) for n in lengths]
        for r in points:
            print(r, flush=True)
        xs, ys = [float(r["per_rank"]) for r in points], [r["peak_mib"] for r in points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        icpt = my - slope * mx
        base = max(r["base_mib"] for r in points)
        budget = budget_gib * 1024
        shared = (budget / world - base - icpt) / slope * world  # all P on one machine
        own = (budget - base - icpt) / slope * world  # one device of budget per rank
        step = world * chunk
        rows.append(dict(
            world=world, points=[(int(x), round(y)) for x, y in zip(xs, ys)], base_mib=base,
            mib_per_1k=slope * 1024, shared=int(shared // step * step), own=int(own // step * step),
        ))  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total", type=int, default=4096, help="strong scaling: total tokens per sequence")
    parser.add_argument("--per-rank", type=int, default=1024, help="weak scaling: tokens per rank")
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--max-context", type=float, metavar="GIB", help="fit the longest context in GIB")
    parser.add_argument("--fit-lengths", default="1024,2048,4096", help="tokens per rank measured")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.max_context:
        lengths = [int(n) for n in args.fit_lengths.split(",")]
        rows = max_context(worlds, lengths, args.max_context, args.steps)
        print(
            f"\n| P | measured (tokens/rank: peak MiB/rank) | base MiB/rank | MiB per 1K tokens/rank | longest L, "
            f"P on one {args.max_context:g} GiB machine | longest L, {args.max_context:g} GiB per rank |"
        )
        print("|---|---|---|---|---|---|")
        for r in rows:
            pts = ", ".join(f"{n}: {m}" for n, m in r["points"])
            print(
                f"| {r['world']} | {pts} | {r['base_mib']:.0f} | {r['mib_per_1k']:.0f} | {r['shared']} | "
                f"{r['own']} |"
            )
        return
    results = []
    for scaling in ("strong", "weak"):
        for world in worlds:
            total = args.total if scaling == "strong" else args.per_rank * world
            for mode in ("parallel", "sequential") if world > 1 else ("-",):
                r = run(world, mode, total, args.steps)
                r["scaling"] = scaling
                results.append(r)
                print(r, flush=True)
    if args.markdown:
        print(f"\nmodel {MODEL}; batch 1; {args.steps} timed steps, 1 thread per process; "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores\n")  # fmt: skip
        print(
            "| scaling | P | mode | total L | L per rank | step (s) | peak mem/rank (MiB) | sent/rank/step "
            "(KiB) | per block (KiB) | last rank blocked in comm (s) | CPU s/rank (max) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['scaling']} | {r['world']} | {r['mode']} | {r['total']} | {r['per_rank']} | "
                  f"{r['step_s']:.3f} | {r['peak_mib']:.0f} | {r['sent_kib']:.1f} | {r['per_block_kib']:.1f} | "
                  f"{r['blocked_s']:.3f} | {r['cpu_s']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
