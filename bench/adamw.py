"""One AdamW step of the small models' parameters with each of torch's kernels (``optim.implementation``).

    python -m bench.adamw                      # pg19_small and debug, 2 threads, 30 rounds
    python -m bench.adamw --threads 1 --rounds 50

The parameters of ``bench.small_models``' two models (pg19_small: 1.44M in 99 tensors; debug: 0.02M in 52),
random gradients, and one ``torch.optim.AdamW`` per implementation over its own copy: ``for-loop`` (a dozen
ops per parameter tensor; what torch picks on the CPU), ``foreach`` (multi-tensor ops; torch's default on
CUDA) and ``fused`` (one kernel for every tensor; the suite's default). The implementations take turns step
by step; the table is the median ``opt.step()`` time after 5 warm-up rounds. The copies start equal, so the
largest parameter difference from the for-loop after the rounds is printed too (float32 rounding).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import machine_description, markdown_table, setup_threads

IMPLEMENTATIONS = ("for-loop", "foreach", "fused")  # optim.implementation's values, the baseline first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    if args.rounds < 6:
        ap.error(f"--rounds {args.rounds}: at least 6 (5 are warm-up)")
    setup_threads(args.threads)
    from bench.small_models import MODELS
    from mega_suite.models import create_model
    from mega_suite.settings import ADAMW_KERNELS  # the flags the suite gives AdamW

    print(f"# python -m bench.adamw {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(machine_description(args.threads))
    rows = []
    for name, spec in MODELS.items():
        torch.manual_seed(0)
        base = create_model(spec["preset"], **spec["overrides"])
        grads = [torch.randn_like(p) for p in base.parameters()]
        opts = {}
        for impl in IMPLEMENTATIONS:
            model = copy.deepcopy(base)
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            opts[impl] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3, **ADAMW_KERNELS[impl]))
        times = {impl: [] for impl in opts}
        for _ in range(args.rounds):
            for impl, (_, opt) in opts.items():
                t0 = time.perf_counter()
                opt.step()
                times[impl].append(time.perf_counter() - t0)
        reference = list(opts["for-loop"][0].parameters())
        drift = {
            impl: max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference))
            for impl, (model, _) in opts.items()
        }
        med = {impl: statistics.median(t[5:]) * 1e3 for impl, t in times.items()}
        params = sum(p.numel() for p in base.parameters())
        rows.append([
            name, f"{params / 1e6:.2f}M in {len(grads)} tensors",
            *(f"{med[i]:.2f} ms ({med['for-loop'] / med[i]:.1f}x)" for i in IMPLEMENTATIONS),
            f"{max(drift.values()):.1e}",
        ])  # fmt: skip
    print(f"\nOne opt.step(), median of {args.rounds - 5} rounds (x: speed over the for-loop):\n")
    print(markdown_table(["model", "parameters", *IMPLEMENTATIONS, "largest difference"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
