"""Causal chunked attention with unequal head widths on the CPU: the two reference paths side by side.

    python -m bench.diagnostics.attention_cpu                       # fp32, the grid below, 2 threads
    python -m bench.diagnostics.attention_cpu --dtype bfloat16 --threads 1

For q, k [B, L, 1, dk] and v [B, L, 1, dv] (dk < dv; L / C chunks per sequence), causal, no padding, no
dropout, forward + backward (or ``--forward-only``) of
``kernels.attention.reference.chunk_attention`` through

- ``padded flash``: Q and K zero-padded to dv so that SDPA's CPU flash kernel applies (exact; costs dv-wide
  QKᵀ products and padded copies of Q and K);
- ``blocked``: ``_BlockedCausal``, query blocks of C/4 rows against the keys up to their end (5/8 of the
  C x C scores), P materialised per block in float32 and recomputed in backward, dk-wide QKᵀ.

Both in the same process, alternating, median of the timed repetitions after one warm-up; ``chosen`` is the
path ``chunk_attention`` takes for that shape (``reference._prefer_blocked``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench.common import machine_description, markdown_table

WIDTHS = [(32, 128), (64, 128), (64, 256), (128, 256), (128, 512)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--length", type=int, default=2048, help="tokens per sequence (at least C)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--batch", default="1,4", help="comma-separated batch sizes (one head)")
    ap.add_argument("--chunks", default="256,512,1024,2048", help="comma-separated chunk sizes C")
    ap.add_argument("--forward-only", action="store_true", help="no autograd (evaluation)")
    args = ap.parse_args(argv)
    batches, chunks = ([int(v) for v in a.split(",")] for a in (args.batch, args.chunks))
    grid = [(dk, dv, c, bh) for dk, dv in WIDTHS for c in chunks for bh in batches]
    torch.set_num_threads(args.threads)
    from kernels.attention import reference as ref

    dtype = getattr(torch, args.dtype)
    print(machine_description(args.threads))
    prefer = ref._prefer_blocked
    rows = []
    for dk, dv, c, bh in grid:
        n = max(args.length, c)
        grad = not args.forward_only
        q, k = (torch.randn(bh, n, 1, dk, dtype=dtype, requires_grad=grad) for _ in range(2))
        v = torch.randn(bh, n, 1, dv, dtype=dtype, requires_grad=grad)
        g = torch.randn(bh, n, 1, dv, dtype=dtype)
        times = {"padded flash": [], "blocked": []}
        try:
            for _ in range(args.repeat + 1):
                for name in times:
                    ref._prefer_blocked = lambda *a, name=name: name == "blocked"
                    t0 = time.perf_counter()
                    out = ref.chunk_attention(q, k, v, c, True)
                    if grad:
                        out.backward(g)
                    times[name].append(time.perf_counter() - t0)
        finally:
            ref._prefer_blocked = prefer
        flash, blocked = (statistics.median(t[1:]) * 1e3 for t in times.values())
        chosen = "blocked" if prefer(bh * n // c, c, dk, dv, dtype) else "padded flash"
        rows.append([dk, dv, c, bh, f"{flash:.1f}", f"{blocked:.1f}", f"{blocked / flash:.2f}", chosen])
        print(" | ".join(map(str, rows[-1])), flush=True)
    what = "forward only" if args.forward_only else "forward + backward"
    print(
        f"\n{args.dtype}, L = {args.length} (L / C chunks per sequence), {what}, median ms of {args.repeat}\n"
    )
    print(markdown_table(["dk", "dv", "C", "batch", "padded flash ms", "blocked ms", "blocked / flash", "chosen"],
                         rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
