"""The float32 decode packs' storage layout, A/B in one process: W [O, I] where I > O (this code) against Wᵀ
[I, O] for every pack (before), each through its own compiled ``decode.StaticDecoder``, token by token round
robin with the fp32 weight-read floor (one ``torch.mv`` over as many weights).

    python -m bench.decode_layout --threads 1 --prompt 512 --tokens 80
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

from bench.common import machine_description, markdown_table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from mega_suite.models import count_parameters, create_model
    from mega_suite.models.megalodon import decode

    torch.manual_seed(0)
    base = create_model("megalodon_cpu_bench").eval()
    prompt = torch.randint(0, base.cfg.vocab_size, (1, args.prompt))
    new_init = decode.Gemv.__init__

    def all_transposed(self, weight, bias, dtype, kind):  # the layout before: Wᵀ [I, O] for every pack
        new_init(self, weight, bias, dtype, kind)
        if getattr(self, "dot", False):
            self.w, self.dot = self.w.t().contiguous(), False

    decoders = {}
    for name, init in (("W [O, I] where I > O", new_init), ("Wᵀ [I, O] everywhere (before)", all_transposed)):
        model = copy.deepcopy(base)
        with torch.no_grad():
            _, cache = model(prompt, use_cache=True)
        decode.Gemv.__init__ = init
        try:
            model.to_decode_dtype(torch.float32, "matmul").decode_plan()
        finally:
            decode.Gemv.__init__ = new_init
        decoders[name] = decode.StaticDecoder(model, cache, compile=True)
    numel = count_parameters(base)
    w, x = torch.randn((numel + 1023) // 1024, 1024), torch.randn(1024)
    print(machine_description(args.threads))
    rows = []
    for r in range(1, args.rounds + 1):
        times = {name: [] for name in ["floor fp32 mv", *decoders]}
        tokens = {name: torch.zeros(1, dtype=torch.long) for name in decoders}
        for _ in range(args.tokens):
            for name in times:
                t0 = time.perf_counter()
                if name in decoders:
                    tokens[name] = decoders[name].step(tokens[name]).argmax(-1)
                else:
                    torch.mv(w, x)
                times[name].append(time.perf_counter() - t0)
        floor = statistics.median(times["floor fp32 mv"])
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append([r, name, f"{med * 1e3:.2f}", f"{med / floor:.2f}x"])
    print(f"\nmegalodon_cpu_bench, fp32 compiled step, prompt {args.prompt}, {args.tokens} tokens round robin, "
          f"median ms per token\n")  # fmt: skip
    print(markdown_table(["round", "path", "ms/token", "/ floor"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
