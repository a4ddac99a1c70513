"""Where a 7B-width block's GPU time goes: torch.profiler's kernel table for one Megalodon and one Llama block.

    python -m bench.diagnostics.gpu_profile                 # L = 4096, bf16-mixed, forward + backward, top 30 kernels
    python -m bench.diagnostics.gpu_profile --length 32768 --top 20
    python -m bench.diagnostics.gpu_profile --walls 4096,32768    # wall ms, eager and torch.compile'd, no profile
    python -m bench.diagnostics.gpu_profile --walls 4096 --modes eager,default,reduce-overhead   # + CUDA graphs

The blocks are gpu_bench's block stages' (bench/block.py ``build_block`` at the 7B widths). After three
warm-up steps (Triton autotune, cuBLAS heuristics), one step is profiled; the table lists the device kernels
by total device time, with the share of the step each takes, so the gap between the two blocks can be
attributed to kernels rather than guessed.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench.common import markdown_table


def kernel_rows(prof, top: int) -> tuple[list[list], float, int]:
    """(rows of [kernel, calls, total ms, share], total device ms, kernel count) from a finished profile."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name if len(e.name) <= 70 else e.name[:67] + "..."
            totals[name][0] += 1
            totals[name][1] += e.device_time_total / 1e3
    total = sum(v[1] for v in totals.values())
    count = sum(int(v[0]) for v in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    rows = [[f"`{n}`", int(c), f"{ms:.3f}", f"{ms / total:.1%}"] for n, (c, ms) in ranked]
    return rows, total, count


def profile_block(kind: str, length: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_bench import block_step

    step, grads = block_step(kind, length)
    for _ in range(3):
        for t in grads:
            t.grad = None
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows, total, count = kernel_rows(prof, top)
    head = f"### {kind}, L {length}: {total:.2f} ms of kernels, {count} kernels per step\n\n"
    return head + markdown_table(["kernel", "calls", "ms", "share"], rows) + "\n"


def walls(lengths: list[int], out: Path | None, modes: tuple[str, ...] = ("eager", "default")) -> int:
    """Median fwd+bwd wall ms of each block, eager and compiled (gpu_bench's ``block_step``; a mode other than
    "eager" is torch.compile's, e.g. "reduce-overhead": CUDA graphs), and M / L."""
    import time

    from bench.gpu_bench import block_step, median_ms

    rows = []
    for mode in modes:
        for length in lengths:
            t0 = time.perf_counter()
            t = {kind: median_ms(*block_step(kind, length, mode)) for kind in ("megalodon", "llama")}
            torch.cuda.empty_cache()
            label = (
                "eager" if mode == "eager" else "torch.compile" + ("" if mode == "default" else f" {mode}")
            )
            rows.append([label, length, f"{t['megalodon']:.1f}",
                         f"{t['llama']:.1f}", f"{t['megalodon'] / t['llama']:.2f}",
                         f"{time.perf_counter() - t0:.0f}"])  # fmt: skip
            print(" | ".join(map(str, rows[-1])), flush=True)
    text = markdown_table(["mode", "L", "Megalodon ms", "Llama ms", "M / L", "s (incl. compile)"], rows)
    print("\n" + text)
    if out:
        out.write_text(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--walls", default=None, help="comma list of lengths: wall ms eager and compiled instead")
    ap.add_argument(
        "--modes", default="eager,default",
        help="with --walls: eager and/or torch.compile modes (default, reduce-overhead, max-autotune, ...)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    modes = tuple(args.modes.split(","))
    from mega_suite.config import COMPILE_MODES

    if any(m not in ("eager", *COMPILE_MODES) for m in modes):
        ap.error(f"--modes {args.modes}: each of eager, {', '.join(COMPILE_MODES)}")
    if not torch.cuda.is_available():
        print("bench.diagnostics.gpu_profile: needs a CUDA device", file=sys.stderr)
        return 2
    if args.walls:
        return walls([int(n) for n in args.walls.split(",")], args.out, modes)
    text = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, bf16-mixed, fwd + bwd, batch 1\n\n"
    for kind in ("megalodon", "llama"):
        part = profile_block(kind, args.length, args.top)
        print(part, flush=True)
        text += part + "\n"
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
