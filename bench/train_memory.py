"""Training step memory and time, this checkout beside another one (e.g. before the saved-tensor work).

    git worktree add /tmp/mem_base a2b2f19
    python -m bench.train_memory --baseline /tmp/mem_base                    # both workloads, 2 rounds
    python -m bench.train_memory --baseline /tmp/mem_base --only lm --lengths 2K,4K --rounds 3
    python -m bench.train_memory --baseline /tmp/mem_base --only ckpt --ckpt-lengths 16K,32K --steps 2

Workloads (fp32, train mode, ``--threads`` threads):

- ``listops``: the main job's model, ``create_model("lra_listops")``, a batch of [B, 2000] tokens with the
  second half of the batch padded from step 1500 on, forward + cross-entropy + backward, no warm-up. B = 64
  (the main job) in fresh processes, old then new, one at a time (``--rounds``): peak memory and the time of
  that first step; B = ``--timing-batch`` in the paired mode below for the time;
- ``lm``: ``megalodon_cpu_bench`` on [1, L] tokens, next-token cross-entropy, forward + backward; one warm-up
  step, then ``--steps`` timed steps, paired;
- ``ckpt``: the same with activation checkpointing (``model.gradient_checkpointing``) at ``--ckpt-lengths``,
  in fresh processes one at a time (one warm-up, then the best of ``--steps``; peak over all of them).

Each process has ``PYTHONPATH`` at one checkout (``new`` = this one, ``old`` = ``--baseline``). Paired: the
old and the new process are both alive and take steps in turn (old, new, old, new, ...), so both see the same
load on a shared machine; the best step of each is reported. Peak = each process's ``ru_maxrss`` (VmHWM,
model and inputs included); "s" is wall time, "CPU s" the process's CPU time (all threads). The ratio
new / old is per pair, never against a figure from another time.
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
kind, length, repeat, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[5]), int(sys.argv[6])
if kind == "listops":
    model = create_model("lra_listops").train()
    x = torch.randint(0, 15, (batch, length))
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[batch // 2 :, length * 3 // 4 :] = True
    y = torch.randint(0, 10, (batch,))
    def step():
        loss = F.cross_entropy(model(x, padding_mask=mask), y)
        loss.backward()
    warm = False
else:
    model = create_model("megalodon_cpu_bench").train()
    model.gradient_checkpointing = kind == "lm_ckpt"
    x = torch.randint(0, 512, (1, length + 1))
    def step():
        logits = model(x[:, :-1])[0]
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
    warm = True
if warm:
    step()
    model.zero_grad(set_to_none=True)
times, cpu = [], []
for line in sys.stdin:  # one timed step per "step" line (paired mode), or `repeat` steps at once
    n = repeat if line.strip() == "all" else 1
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        model.zero_grad(set_to_none=True)
    print(json.dumps(dict(s=times[-1], cpu=cpu[-1])), flush=True)
    if line.strip() == "all":
        break
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(s=min(times), cpu=min(cpu), peak=peak)), flush=True)
"""


def _child(root: Path, kind: str, length: int, threads: int, repeat: int, batch: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS=str(threads))
    args = [sys.executable, "-c", CHILD, kind, str(length), str(threads), str(root), str(repeat), str(batch)]
    return subprocess.Popen(
        args,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=root,
    )


def _reply(proc: subprocess.Popen, what: str) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"{what} failed:\n{proc.stderr.read()[-3000:]}")
    return json.loads(line)


def run(root: Path, kind: str, length: int, threads: int, repeat: int, batch: int) -> dict:
    """One fresh process: ``repeat`` timed steps; its own peak RSS."""
    proc = _child(root, kind, length, threads, repeat, batch)
    proc.stdin.write("all\n")
    proc.stdin.flush()
    _reply(proc, f"{kind} L={length} in {root}")
    out = _reply(proc, f"{kind} L={length} in {root}")
    proc.wait()
    return out


def run_paired(old_root: Path, new_root: Path, kind: str, length: int, threads: int, steps: int, batch: int):
    """Both processes alive at once, stepping in turn old, new, old, new ... (``steps`` each): both see the
    same machine load; the best step of each. Peak RSS is each process's own."""
    procs = [_child(r, kind, length, threads, steps, batch) for r in (old_root, new_root)]
    for _ in range(steps):
        for proc in procs:
            proc.stdin.write("step\n")
            proc.stdin.flush()
            _reply(proc, f"{kind} L={length}")
    outs = []
    for proc in procs:
        proc.stdin.close()
        outs.append(_reply(proc, f"{kind} L={length}"))
        proc.wait()
    return outs


def _row(name: str, r: int, old: dict, new: dict) -> list[str]:
    return [
        name, str(r), f"{old['s']:.2f}", f"{new['s']:.2f}", f"{new['s'] / old['s']:.2f}",
        f"{old['cpu']:.2f}", f"{new['cpu']:.2f}", f"{new['cpu'] / old['cpu']:.2f}",
        f"{old['peak'] / 2**30:.2f}", f"{new['peak'] / 2**30:.2f}", f"{new['peak'] / old['peak']:.2f}",
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, type=Path, help="checkout of the old code (git worktree)")
    ap.add_argument("--only", choices=["listops", "lm", "ckpt"], default=None)
    ap.add_argument("--lengths", default="2K,4K,8K", help="lm lengths")
    ap.add_argument("--ckpt-lengths", default="16K,32K", help="lm lengths with activation checkpointing")
    ap.add_argument("--rounds", type=int, default=1, help="fresh old / new process pairs for listops 64x2000")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process in the paired runs")
    ap.add_argument("--timing-batch", type=int, default=16, help="listops batch of the paired timing run")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not (args.baseline / "mega_suite").is_dir():
        raise SystemExit(f"--baseline {args.baseline} is not a mega-suite checkout (no mega_suite/ in it)")
    old_root, t = args.baseline.resolve(), args.threads
    print(f"# bench/train_memory.py: {machine_description()}; {t} threads")
    print(f"# old = {old_root}, new = {HERE}\n")
    rows = []

    def report(row: list[str]) -> None:
        rows.append(row)
        print(" | ".join(row), flush=True)

    if args.only in (None, "listops"):
        for r in range(args.rounds):  # one at a time: the old one peaks at ~11 GiB
            old = run(old_root, "listops", 2000, t, 1, 64)
            new = run(HERE, "listops", 2000, t, 1, 64)
            report(_row("lra_listops 64x2000, fresh", r + 1, old, new))
        b = args.timing_batch
        old, new = run_paired(old_root, HERE, "listops", 2000, t, args.steps, b)
        report(_row(f"lra_listops {b}x2000, paired", 1, old, new))
    if args.only in (None, "lm"):
        for n in parse_lengths(args.lengths):
            old, new = run_paired(old_root, HERE, "lm", n, t, args.steps, 1)
            report(_row(f"cpu_bench 1x{n}, paired", 1, old, new))
    if args.only in (None, "ckpt"):
        for n in parse_lengths(args.ckpt_lengths):  # fresh processes one at a time: the old one peaks high
            old = run(old_root, "lm_ckpt", n, t, args.steps, 1)
            new = run(HERE, "lm_ckpt", n, t, args.steps, 1)
            report(_row(f"cpu_bench 1x{n}, checkpointing, fresh", 1, old, new))
    print()
    heads = ["workload", "round", "old s", "new s", "new/old", "old CPU s", "new CPU s", "new/old"]
    heads += ["old peak GiB", "new peak GiB", "new/old"]
    print(markdown_table(heads, rows))


if __name__ == "__main__":
    main()
