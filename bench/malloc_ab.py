"""Allocators and glibc malloc settings against the language model's peak RSS and step time
(bench/RESULTS.md §17, §23).

    python -m bench.malloc_ab                                  # 2K, 4K, 8K; all settings; 2 rounds
    python -m bench.malloc_ab --lengths 4K --modes default,trim --rounds 3
    python -m bench.malloc_ab --modes default,tcmalloc,jemalloc

``megalodon_cpu_bench``, [1, L] tokens, fp32, AdamW, 2 threads; each (L, setting) runs in a fresh process,
the settings taking turns within a round: one warm-up step, then the best of ``--steps`` steps; peak =
the process's ``ru_maxrss``; "sys s" = its kernel CPU time over all steps (page faults). Settings:

- ``default``: glibc as it comes (blocks above a dynamic threshold, up to 32 MiB, are mmapped);
- ``mmap1M``: ``mallopt(M_MMAP_THRESHOLD, 1 MiB)``: every block of 1 MiB or more is mmapped and returned
  on free (and page-faulted again when allocated);
- ``trim``: ``malloc_trim(0)`` once before each backward (freed heap pages handed back to the kernel);
- ``trim_blocks``: ``malloc_trim(0)`` before every block's forward and backward;
- ``tcmalloc`` / ``jemalloc``: that allocator in ``LD_PRELOAD`` (as ``run.py`` does, ``mega_suite.malloc``);
  a mode whose library is not installed is left out with a note.
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
from mega_suite import malloc

HERE = Path(__file__).resolve().parents[1]
PRELOADED = tuple(malloc.LIBRARIES)  # tcmalloc, jemalloc
MODES = ("default", "mmap1M", "trim", "trim_blocks", *PRELOADED)

CHILD = r"""
import ctypes, json, resource, sys, time
length, mode, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
libc = ctypes.CDLL("libc.so.6")
if mode == "mmap1M":
    assert libc.mallopt(-3, 1 << 20) == 1  # M_MMAP_THRESHOLD
import torch
import torch.nn.functional as F
torch.set_num_threads(2)
from mega_suite.models import create_model
torch.manual_seed(0)
model = create_model("megalodon_cpu_bench").train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, 512, (1, length + 1))
def trim(*args):  # a hook: returns None (a value would replace the block's input)
    libc.malloc_trim(0)
if mode == "trim_blocks":
    for block in model.layers:
        block.register_forward_pre_hook(trim)
        block.register_full_backward_pre_hook(trim)
times = []
for _ in range(steps + 1):
    t = time.perf_counter()
    logits = model(x[:, :-1])[0]
    loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    if mode.startswith("trim"):
        trim()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del logits, loss
    times.append(time.perf_counter() - t)
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps(dict(s=min(times[1:]), sys=ru.ru_stime, peak=ru.ru_maxrss * 1024)))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="2K,4K,8K")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"--modes {','.join(bad)}: expected some of {', '.join(MODES)}")
    print(f"# bench/malloc_ab.py: {machine_description()}\n")
    env = {m: {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", malloc.MARK)} for m in modes}
    for m in [m for m in modes if m in PRELOADED]:
        lib = malloc.find(m)
        if lib is None:
            print(f"{m}: not installed ({' / '.join(malloc.LIBRARIES[m])}), left out")
            modes.remove(m)
        else:
            print(f"{m}: {lib}")
            env[m] = malloc.restart_env(env[m], lib)
    rows = []
    for n in parse_lengths(args.lengths):
        for r in range(args.rounds):
            base = None
            for mode in modes:
                cmd = [sys.executable, "-c", CHILD, str(n), mode, str(args.steps)]
                proc = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, env=env[mode])
                if proc.returncode:
                    raise SystemExit(f"L={n} {mode} failed:\n{proc.stderr[-3000:]}")
                out = json.loads(proc.stdout.strip().splitlines()[-1])
                base = base or out
                row = [str(n), str(r + 1), mode, f"{out['s']:.2f}", f"{out['s'] / base['s']:.2f}"]
                row += [
                    f"{out['sys']:.1f}",
                    f"{out['peak'] / 2**30:.2f}",
                    f"{out['peak'] / base['peak']:.2f}",
                ]
                rows.append(row)
                print(" | ".join(row), flush=True)
    heads = ["L", "round", "setting", "step s", "x first", "sys s", "peak GiB", "x first"]
    print("\n" + markdown_table(heads, rows))


if __name__ == "__main__":
    main()
