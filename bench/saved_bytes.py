"""What one Megalodon block stores for backward, per token: bytes by autograd node and saved tensor.

    python -m bench.saved_bytes                          # megalodon_cpu_bench block, L = 2048
    python -m bench.saved_bytes --preset megalodon_debug --length 256 --top 40

Runs one block forward on [1, L, D] with autograd and walks the graph from the output: every
``_saved_*`` tensor of every node, counted once per storage (views and tensors saved twice share it), the
block's input and parameters excluded. Bytes are storage bytes / L: what training keeps per token per layer until backward.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import markdown_table
from mega_suite.models.megalodon.lean import is_rebuilt


def saved_bytes(block: torch.nn.Module, x: torch.Tensor) -> collections.Counter:
    """{(node, attribute, shape, dtype): storage bytes} of what ``block(x)`` saves for backward."""
    out = block(x)[0]
    seen = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in block.parameters()}
    by = collections.Counter()
    stack, visited = [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in visited:
            continue
        visited.add(fn)
        names = [n for n in dir(fn) if n.startswith("_saved_")]
        if isinstance(fn, torch.autograd.function.BackwardCFunction):  # a custom autograd.Function
            names.append("saved_tensors")
        for name in names:
            try:
                value, again = getattr(fn, name), getattr(fn, name)
            except Exception:  # noqa: BLE001 - some saved attributes are not readable (freed, symbolic)
                continue
            name = name if name.startswith("_saved_") else "_saved_" + name
            values = value if isinstance(value, (tuple, list)) else [value]
            agains = again if isinstance(again, (tuple, list)) else [again]
            for t, t2 in zip(values, agains):
                if isinstance(t, torch.Tensor) and (
                    t.untyped_storage().data_ptr() != t2.untyped_storage().data_ptr() or is_rebuilt(t)
                ):
                    continue  # rebuilt when read (a saved-tensor hook recomputes it): nothing is stored
                if isinstance(t, torch.Tensor) and t.numel() > 0:
                    storage = t.untyped_storage()
                    if storage.data_ptr() in seen:
                        continue
                    seen.add(storage.data_ptr())
                    by[type(fn).__name__, name[len("_saved_") :], tuple(t.shape), str(t.dtype)] += (
                        storage.nbytes()
                    )
        stack.extend(f for f, _ in fn.next_functions)
    return by


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="megalodon_cpu_bench")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    from mega_suite import create_model

    torch.manual_seed(0)
    model = create_model(args.preset).train()
    x = torch.randn(1, args.length, model.cfg.model_dim, requires_grad=True)
    by = saved_bytes(model.layers[0], x)
    total = sum(by.values())
    L = args.length
    print(f"# bench/saved_bytes.py ({args.preset}, L = {L}): one block saves {total / 2**20:.1f} MiB = "
          f"{total / L / 1024:.1f} KiB per token per layer\n")  # fmt: skip
    rows = [
        [node, attr, str(list(shape)), dtype.replace("torch.", ""), f"{b / L:.0f}", f"{100 * b / total:.1f}%"]
        for (node, attr, shape, dtype), b in by.most_common(args.top)
    ]
    print(markdown_table(["node", "saved", "shape", "dtype", "bytes / token", "share"], rows))


if __name__ == "__main__":
    main()
