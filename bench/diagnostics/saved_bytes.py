"""What one Megalodon block stores for backward, per token: bytes by autograd node and saved tensor.

    python -m bench.diagnostics.saved_bytes                          # megalodon_cpu_bench block, L = 2048
    python -m bench.diagnostics.saved_bytes --preset megalodon_debug --length 256 --top 40
    python -m bench.diagnostics.saved_bytes --preset lra_listops --length 2000 --batch 4 --baseline /tmp/mem_base
    python -m bench.diagnostics.saved_bytes --preset lra_listops --length 2000 --batch 4 --bf16 --top 12   # under autocast

``--baseline PATH`` measures the same block with the code of another checkout (a ``git worktree`` of an older
commit) in a subprocess and prints its table beside this one's: before / after.
Runs one block forward on [1, L, D] with autograd and walks the graph from the output: every
``_saved_*`` tensor of every node, counted once per storage (views and tensors saved twice share it), the
block's input and parameters excluded; a saved tensor that a saved-tensor hook rebuilds when backward reads it
(``lean.recompute_saved``) is not stored and not counted. Bytes are storage bytes / (B L): what training keeps
per token per layer until backward. Tensors without a batch dimension (the CEMA kernel, its power tables) are
divided by B too, so ``--batch`` shows which part grows with the batch.
Each title also gives what glibc's malloc still holds per token after the forward, less the output: the
stored bytes plus anything kept alive outside the graph (a closure): the two agree when nothing leaks.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if os.environ.get("SAVED_BYTES_ROOT"):  # --baseline's subprocess: that checkout's code
    sys.path.insert(0, os.environ["SAVED_BYTES_ROOT"])

import torch

from bench.common import markdown_table

try:
    from mega_suite.models.megalodon.lean import is_rebuilt
except ImportError:  # a checkout from before lean.py: nothing is rebuilt

    def is_rebuilt(t: torch.Tensor) -> bool:
        return False


HERE = Path(__file__).resolve().parents[2]


def _load_memory():
    """``mega_suite/tools/memory.py`` of this checkout, loaded by path: with ``--baseline`` the ``mega_suite``
    package on the path is the other checkout's, which may predate it."""
    spec = importlib.util.spec_from_file_location("_mega_memory", HERE / "mega_suite" / "tools" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_memory = _load_memory()
stored_for_backward = _memory.stored_for_backward


def saved_bytes(block: torch.nn.Module, x: torch.Tensor) -> collections.Counter:
    """{(node, attribute, shape, dtype): storage bytes} of what ``block(x)`` saves for backward (the block's
    input and parameters excluded)."""
    out = block(x)[0]
    return stored_for_backward(out, exclude=[x, *block.parameters()], rebuilt=is_rebuilt)


def measure(preset: str, length: int, batch: int, bf16: bool = False) -> tuple[list[list], int | None]:
    """([[node, attribute, shape, dtype, bytes], ...], live bytes) of one block of ``preset`` on
    [batch, length, D], forward under bf16 autocast with ``bf16``. Live bytes: what malloc holds after the
    forward beyond before it, less the output (None without glibc): the stored bytes plus anything kept
    alive outside the graph."""
    import gc

    from mega_suite import create_model

    torch.manual_seed(0)
    block = create_model(preset).train().layers[0]
    x = torch.randn(batch, length, block.cfg.model_dim, requires_grad=True)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=bf16)
    with autocast:
        block(x)  # warm-up: lazily built tables, allocator pools
    gc.collect()
    try:
        before = _memory.malloc_live_bytes()
    except (OSError, AttributeError):
        before = None
    with autocast:
        out = block(x)[0]
    gc.collect()
    live = None if before is None else _memory.malloc_live_bytes() - before - out.untyped_storage().nbytes()
    by = stored_for_backward(out, exclude=[x, *block.parameters()], rebuilt=is_rebuilt)
    rows = [[node, attr, list(shape), dtype, b] for (node, attr, shape, dtype), b in by.most_common()]
    return rows, live


def table(rows: list[list], live: int | None, tokens: int, top: int, title: str) -> str:
    total = sum(r[-1] for r in rows)
    held = "" if live is None else f"; malloc holds {live / tokens:.0f} B per token after the forward"
    head = (f"# {title}: one block saves {total / 2**20:.1f} MiB = "
            f"{total / tokens / 1024:.1f} KiB per token per layer{held}\n\n")  # fmt: skip
    body = [
        [node, attr, str(shape), dtype.replace("torch.", ""), f"{b / tokens:.0f}", f"{100 * b / total:.1f}%"]
        for node, attr, shape, dtype, b in rows[:top]
    ]
    return head + markdown_table(["node", "saved", "shape", "dtype", "bytes / token", "share"], body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="megalodon_cpu_bench")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--baseline", type=Path, help="another checkout: its table beside this one (before / after)"
    )
    ap.add_argument("--bf16", action="store_true", help="forward under CPU bf16 autocast")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows, live = measure(args.preset, args.length, args.batch, args.bf16)
    if args.json:
        print(json.dumps(dict(rows=rows, live=live)))
        return
    tokens = args.length * args.batch
    what = f"{args.preset}, B = {args.batch}, L = {args.length}{', bf16 autocast' if args.bf16 else ''}"
    if args.baseline is not None:
        if not (args.baseline / "mega_suite").is_dir():
            raise SystemExit(
                f"--baseline {args.baseline} is not a mega-suite checkout (no mega_suite/ in it)"
            )
        cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--preset", args.preset]
        cmd += ["--length", str(args.length), "--batch", str(args.batch)] + ["--bf16"] * args.bf16
        env = dict(os.environ, SAVED_BYTES_ROOT=str(args.baseline.resolve()))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"the baseline run failed:\n{proc.stderr[-3000:]}")
        baseline = json.loads(proc.stdout.strip().splitlines()[-1])
        old, old_live = baseline["rows"], baseline["live"]
        before, after = sum(r[-1] for r in old) / tokens, sum(r[-1] for r in rows) / tokens
        print(f"# before {before / 1024:.1f} KiB, after {after / 1024:.1f} KiB per token per layer "
              f"({after / before:.2f}x) -- {what}\n")  # fmt: skip
        print(table(old, old_live, tokens, args.top, f"before ({args.baseline})") + "\n")
    print(table(rows, live, tokens, args.top, f"bench/diagnostics/saved_bytes.py ({what})"))


if __name__ == "__main__":
    main()
