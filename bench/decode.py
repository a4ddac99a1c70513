"""Single-token decode of ``megalodon_cpu_bench`` against the weight-read floor, all in one process.

    python -m bench.decode                       # 3 rounds, prompt 300, 60 tokens per measurement
    python -m bench.decode --rounds 5 --tokens 100 --profile

Per round, alternating: the fp32 weight-read floor (one GEMV over a matrix holding as many fp32 values as
the model has parameters, ``bench.common.weight_read_floor``), the same in bf16, greedy decode through the
segment path (``forward_hidden`` pieces: the full-pass kernels on one token), through the one-token path
(``MegalodonBlock.step``), and through the one-token path with bf16 decode weights
(``model.to_decode_dtype(torch.bfloat16)``). Median ms/token over the tokens after 5 warm-up tokens.
``--profile`` adds the aten op count and the time by op of one step of the one-token path.
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

from bench.common import machine_description, markdown_table, setup_threads, weight_read_floor


def decode_ms(model, prompt, tokens: int, one_token_path: bool) -> float:
    from mega_suite.models.megalodon.model import MegalodonLM

    can_step = MegalodonLM._can_step
    if not one_token_path:
        MegalodonLM._can_step = lambda self, cache: False
    try:
        with torch.inference_mode():
            logits, cache = model(prompt, use_cache=True)
            token = logits[:, -1:].argmax(-1)
            times = []
            for _ in range(tokens + 5):
                t0 = time.perf_counter()
                logits, cache = model(token, cache)
                token = logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - t0)
    finally:
        MegalodonLM._can_step = can_step
    return statistics.median(times[5:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    setup_threads()
    print(f"# bench/decode.py  ({' '.join(sys.argv[1:]) or 'defaults'})")
    print(machine_description())
    from mega_suite import create_model

    torch.manual_seed(0)
    model = create_model("megalodon_cpu_bench").eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, args.prompt))
    rows = []
    for r in range(args.rounds):
        floor = weight_read_floor(model) * 1e3
        floor16 = weight_read_floor(model, torch.bfloat16) * 1e3
        seg = decode_ms(model, prompt, args.tokens, False)
        step = decode_ms(model, prompt, args.tokens, True)
        model.to_decode_dtype(torch.bfloat16)
        step16 = decode_ms(model, prompt, args.tokens, True)
        model.to_decode_dtype(None)
        rows.append([
            str(r + 1), f"{floor:.2f}", f"{floor16:.2f}", f"{seg:.2f}", f"{step:.2f}", f"{step / floor:.2f}x",
            f"{seg / step:.2f}x", f"{step16:.2f}", f"{step16 / floor16:.2f}x",
        ])  # fmt: skip
        print("  " + " | ".join(rows[-1]), flush=True)
    print(
        f"\nGreedy decode, batch 1, prompt {args.prompt}, median of {args.tokens} tokens; floors = one GEMV "
        "over as many weights as the model has, same process, same round:\n"
    )
    print(markdown_table(
        ["round", "fp32 floor ms", "bf16 floor ms", "segment path ms", "one-token path ms", "/ fp32 floor",
         "speed-up", "bf16 weights ms", "/ bf16 floor"],
        rows,
    ))  # fmt: skip
    if args.profile:
        with torch.inference_mode():
            logits, cache = model(prompt, use_cache=True)
            token = logits[:, -1:].argmax(-1)
            logits, cache = model(token, cache)  # a cache is continued once (twice would copy its KV)
            with torch.profiler.profile() as prof:
                model(token, cache)
        events = prof.key_averages()
        top = [e for e in events if e.key.startswith("aten::")]
        print(f"\naten ops per token (nested calls included): {sum(e.count for e in top)}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
