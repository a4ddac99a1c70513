"""Training step memory and time, this checkout beside another one (e.g. before the saved-tensor work).

    git worktree add /tmp/mem_base a2b2f19
    python -m bench.train_memory --baseline /tmp/mem_base                    # both workloads, 2 rounds
    python -m bench.train_memory --baseline /tmp/mem_base --only lm --lengths 2K,4K --rounds 3

Workloads (fp32, train mode, ``--threads`` threads):

- ``listops``: the main job's model, ``create_model("lra_listops")``, one batch of [64, 2000] tokens with the
  second half of the batch padded from step 1500 on, forward + cross-entropy + backward (one step, as measured
  by hand before: the first step of a run);
- ``lm``: ``megalodon_cpu_bench`` on [1, L] tokens, next-token cross-entropy, forward + backward; one warm-up
  step, then the best of ``--repeat`` steps.

Every measurement is a fresh Python process with ``PYTHONPATH`` at one checkout (``new`` = this one, ``old``
= ``--baseline``), alternating old / new for ``--rounds`` rounds; peak = the child's ``ru_maxrss`` (VmHWM,
model and inputs included); "s" is wall time, "CPU s" the process's CPU time (all threads: less sensitive to
other load on a shared machine). The ratio new / old is printed per pair of runs, never against a figure from
another time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_description, markdown_table, parse_lengths

HERE = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
import torch
import torch.nn.functional as F
torch.set_num_threads(int(sys.argv[3]))
from mega_suite.models import create_model
import mega_suite
assert mega_suite.__file__.startswith(sys.argv[4]), (mega_suite.__file__, sys.argv[4])
torch.manual_seed(0)
kind, length, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[5])
if kind == "listops":
    model = create_model("lra_listops").train()
    x = torch.randint(0, 15, (64, length))
    mask = torch.zeros(64, length, dtype=torch.bool)
    mask[32:, length * 3 // 4 :] = True
    y = torch.randint(0, 10, (64,))
    def step():
        loss = F.cross_entropy(model(x, padding_mask=mask), y)
        loss.backward()
    warm = False
else:
    model = create_model("megalodon_cpu_bench").train()
    x = torch.randint(0, 512, (1, length + 1))
    def step():
        logits = model(x[:, :-1])[0]
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    warm = True
if warm:
    step()
    model.zero_grad(set_to_none=True)
times, cpu = [], []
for _ in range(repeat):
    t, c = time.perf_counter(), time.process_time()
    step()
    times.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
    model.zero_grad(set_to_none=True)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(s=min(times), cpu=min(cpu), peak=peak)))
"""


def run(root: Path, kind: str, length: int, threads: int, repeat: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS=str(threads))
    args = [sys.executable, "-c", CHILD, kind, str(length), str(threads), str(root), str(repeat)]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, cwd=root)
    if proc.returncode:
        raise SystemExit(f"{kind} L={length} in {root} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, type=Path, help="checkout of the old code (git worktree)")
    ap.add_argument("--only", choices=["listops", "lm"], default=None)
    ap.add_argument("--lengths", default="2K,4K,8K", help="lm lengths")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="timed lm steps per process (best)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not (args.baseline / "mega_suite").is_dir():
        raise SystemExit(f"--baseline {args.baseline} is not a mega-suite checkout (no mega_suite/ in it)")
    jobs = []
    if args.only in (None, "listops"):
        jobs.append(("listops", 2000, 1))
    if args.only in (None, "lm"):
        jobs += [("lm", n, args.repeat) for n in parse_lengths(args.lengths)]
    print(f"# bench/train_memory.py: {machine_description()}; {args.threads} threads")
    print(f"# old = {args.baseline.resolve()}, new = {HERE}\n")
    rows = []
    for kind, length, repeat in jobs:
        for r in range(args.rounds):
            old = run(args.baseline.resolve(), kind, length, args.threads, repeat)
            new = run(HERE, kind, length, args.threads, repeat)
            name = "lra_listops 64x2000" if kind == "listops" else f"cpu_bench 1x{length}"
            rows.append([
                name, str(r + 1), f"{old['s']:.2f}", f"{new['s']:.2f}", f"{new['s'] / old['s']:.2f}",
                f"{old['cpu']:.2f}", f"{new['cpu']:.2f}", f"{new['cpu'] / old['cpu']:.2f}",
                f"{old['peak'] / 2**30:.2f}", f"{new['peak'] / 2**30:.2f}", f"{new['peak'] / old['peak']:.2f}",
            ])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    print()
    heads = ["workload", "round", "old s", "new s", "new/old", "old CPU s", "new CPU s", "new/old"]
    heads += ["old peak GiB", "new peak GiB", "new/old"]
    print(markdown_table(heads, rows))


if __name__ == "__main__":
    main()
