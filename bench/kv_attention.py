"""One decode token's attention over the chunk's cached keys and values, float32 against bf16 storage.

    python -m bench.kv_attention                          # megalodon_cpu_bench widths, 512 and 1536 keys
    python -m bench.kv_attention --lengths 64,512,1536 --rounds 300

softmax(q kᵀ) v of one query (zd = 128) over n cached rows (keys [n, 128], values [n, 1024]: one layer of
``megalodon_cpu_bench``, batch 1), as a decode step does it, ``--buffers`` distinct caches taken in turn so
that every call reads them from memory rather than from cache. The attended length grows by one at every
call (``new n``), as in decoding; ``fixed n`` repeats one length. Variants, round robin call by call
(``bf16 mm`` alone, after the others: in turn with them it slows them 1.5-4x):

- ``fp32 mm``: float32 keys / values, two BLAS products (the float32 cache's path, eager);
- ``bf16 mm``: bf16 keys / values and query, two bf16 products (what ``decode.attend`` did for a prompt's
  cache computed under autocast before §25): oneDNN builds a kernel for every new shape;
- ``bf16 cast + fp32 mm``: bf16 storage cast to float32, then float32 BLAS (``attend``, eager);
- ``bf16 compiled``: ``decode.attend`` under torch.compile with bf16 storage, as the compiled decode step
  runs it: over n rounded up to a multiple of 64 (``decode.CPU_KV_BUCKET_ROWS``), the rows past n masked;
  the scores as reductions with the casts fused into them, softmax(·) v one bf16 product;
- ``fp32 compiled``: the same with float32 storage (extern BLAS products).

The table: median µs per call after ``--warmup`` calls, per variant, and the bytes the storage holds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import machine_description, markdown_table, setup_threads


def _mm(q, keys, values, mask):
    """The float32 or bf16 product as written before §25: the query in the storage's dtype."""
    q = q.to(keys.dtype)
    scores = q.reshape(1, -1) @ keys.reshape(keys.shape[1], -1).t()
    return (torch.softmax(scores, -1) @ values.reshape(values.shape[1], -1)).float()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="512,1536", help="comma list of attended lengths to start from")
    ap.add_argument("--rounds", type=int, default=200, help="calls per variant and length")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--buffers", type=int, default=6, help="distinct caches read in turn")
    ap.add_argument("--zd", type=int, default=128)
    ap.add_argument("--value-dim", type=int, default=1024)
    ap.add_argument("--variants", default=None, help="comma list of the variants to time (default: all)")
    args = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--lengths {args.lengths!r}: expected a comma list of integers")
    if not lengths or min(lengths) < 2:
        ap.error(f"--lengths {args.lengths!r}: at least one length, each at least 2")
    if args.rounds <= args.warmup:
        ap.error(f"--rounds {args.rounds} must exceed --warmup {args.warmup}")
    setup_threads(args.threads)
    from mega_suite.models.megalodon import decode

    print(f"# python -m bench.kv_attention {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(machine_description(args.threads))
    capacity = max(lengths) + args.rounds + 64
    gen = torch.Generator().manual_seed(0)
    store = {
        dt: [
            (
                torch.randn(1, capacity, 1, args.zd, generator=gen).to(dt),
                torch.randn(1, capacity, 1, args.value_dim, generator=gen).to(dt),
            )
            for _ in range(args.buffers)
        ]
        for dt in (torch.float32, torch.bfloat16)
    }
    q = torch.randn(1, 1, 1, args.zd, generator=gen) / args.zd**0.5
    compiled = torch.compile(decode.attend, dynamic=True, fullgraph=True)
    variants = {
        "fp32 mm": (torch.float32, _mm, 1),
        "bf16 mm": (torch.bfloat16, _mm, 1),
        "bf16 cast + fp32 mm": (torch.bfloat16, decode.attend, 1),
        "bf16 compiled": (torch.bfloat16, compiled, decode.CPU_KV_BUCKET_ROWS),
        "fp32 compiled": (torch.float32, compiled, 1),
    }
    if args.variants is not None:
        chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in chosen if v not in variants]
        if unknown or not chosen:
            ap.error(
                f"--variants {args.variants!r}: unknown {unknown or 'none given'}; expected {list(variants)}"
            )
        variants = {k: variants[k] for k in chosen}
    rows_of = torch.arange(capacity)

    def call(name: str, i: int, n: int) -> None:
        dt, fn, step = variants[name]
        keys, values = store[dt][i % args.buffers]
        end = -(-n // step) * step
        # the compiled step always masks (rows past t: none when the length is a multiple of the step)
        fn(q, keys[:, :end], values[:, :end], rows_of[:end] >= n if fn is compiled else None)

    for name in variants:  # compile (two lengths: the dynamic one) before any timing
        call(name, 0, 3)
        call(name, 0, 5)
    # bf16 mm is timed on its own, after the others: in turn with them it slowed them 1.5-4x (oneDNN's
    # per-shape kernel generation and threads), which would hide what the others cost in a decode step
    apart = [k for k in variants if k == "bf16 mm"]
    passes = [[k for k in variants if k not in apart]] + [apart] * bool(apart)
    rows = []
    with torch.no_grad():
        for start in lengths:
            for mode in ("new n", "fixed n"):
                times = {name: [] for name in variants}
                for names in passes:
                    for i in range(args.rounds):
                        n = start + i if mode == "new n" else start
                        for name in names:
                            t0 = time.perf_counter()
                            call(name, i, n)
                            times[name].append(time.perf_counter() - t0)
                med = {k: statistics.median(v[args.warmup :]) * 1e6 for k, v in times.items()}
                kib = {b: start * (args.zd + args.value_dim) * b / 1024 for b in (4, 2)}
                rows.append([
                    str(start), mode, f"{kib[4]:.0f} / {kib[2]:.0f}",
                    *(f"{med[k]:.0f}" for k in variants),
                ])  # fmt: skip
                print("  " + " | ".join(rows[-1]), flush=True)
    print(
        f"\nOne query's attention, µs per call (median of {args.rounds - args.warmup}), {args.buffers} caches "
        f"in turn, zd {args.zd}, value width {args.value_dim}, {args.threads} threads:\n"
    )
    print(markdown_table(["n", "lengths", "KiB fp32 / bf16", *variants], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
