"""Single-token decode of ``megalodon_cpu_bench`` against the weight-read floor, all in one process.

    python -m bench.decode                              # 2 threads, 3 rounds of 40 tokens, prompt 300
    python -m bench.decode --threads 1 --rounds 3 --tokens 60 --profile
    python -m bench.decode --paths "bf16 compiled" --prompt 512   # one path (and the floors)
    python -m bench.decode --paths "bf16 compiled,bf16 compiled bf16-kv" --prompt 400 --sweep 1024
    python -m bench.decode --paths "bf16 compiled bf16-kv" --prompt 64 --sweep 1920 --order blocks   # as generate()

Every path runs on its own copy of the model and its own stream, and the paths take turns token by token
(round robin, the floors included), so a load spike on a shared machine hits all of them alike; the caches
are then cold at every token. ``--order blocks`` has each path decode its tokens back to back instead, as
``generate`` does (with ``--sweep``: 128 tokens per turn). Paths:

- floors: one GEMV ``torch.mv(W, x)`` over a [n, 1024] matrix holding as many weights as the model
  (``bench.common.weight_read_floor``'s matrix), row-major (``mv``) and column-major (``mv Wᵀ``: the same
  bytes read as a sum of scaled rows, faster on this CPU); the same in bf16; int8 (``_weight_int8pack_mm``);
- ``segment``: the model's general streaming pass on one token (its packed step switched off);
- ``forward``: the model's own forward with a cache, ``model(tokens, cache)``, as a transformers wrapper or an
  lm-eval adapter calls it (the packed step of ``step.py`` from the model's own plan);
- the one-token path (``decode.Decoder``) with float32 / bfloat16 / int8 weight-only packs and the
  ``matmul`` or ``mkldnn`` GEMV (``decode.Decoder(model, dtype, gemv)``);
- ``compiled``: the same packs through ``decode.StaticDecoder(decoder, cache, compile=True)`` (fixed
  buffers, one Inductor graph per step, compiled once before the rounds; "matmul" packed as "rows", W [O, I],
  whose ``torch.mv`` Inductor compiles into its own reductions, with ``decode.CPU_COMPILE_OPTIONS``);
  ``bf16-kv``: the chunk's keys and values kept in bf16 (``Decoder(..., kv_dtype=torch.bfloat16)``), half
  the bytes a token reads there.

Per round: the median ms/token of each, and each path / the fp32 ``mv`` floor of the same round.

``--port PATH`` (a checkout of the public port, pszemraj/megalodon-hf, as ``bench/peer.py`` takes it; not
vendored): the port's greedy decode joins the round robin as ``port`` (same config as ``bench/peer.py``, its
own cache), a second table gives the suite's ``fp32 matmul`` (``Decoder``), ``forward`` and ``segment`` per
token / the port's, and a third the prompt ingest (``--prompt`` tokens in one streaming call, no autograd,
the suite's model and the port alternating, best of two per round) and its ratio.
``--profile`` adds, per path, the aten ops per token (top-level dispatches, and the profiler's count with
nested calls) and a profile of one step of the first path timed.
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import machine_description, markdown_table, setup_threads

PATHS = [  # name, decode weight dtype, GEMV kind, compiled (``decode.StaticDecoder(compile=True)``), kv_dtype
    ("fp32 matmul", torch.float32, "matmul", False, None),
    ("fp32 mkldnn", torch.float32, "mkldnn", False, None),
    ("bf16 matmul", torch.bfloat16, "matmul", False, None),
    ("bf16 matmul bf16-kv", torch.bfloat16, "matmul", False, torch.bfloat16),
    ("bf16 mkldnn", torch.bfloat16, "mkldnn", False, None),
    ("int8", torch.int8, "matmul", False, None),
    ("fp32 compiled", torch.float32, "matmul", True, None),
    ("bf16 compiled", torch.bfloat16, "matmul", True, None),
    ("bf16 compiled bf16-kv", torch.bfloat16, "matmul", True, torch.bfloat16),
    ("int8 compiled", torch.int8, "matmul", True, None),
]


class Stream:
    """One model copy decoding greedily from its own cache through ``step`` (a ``decode.Decoder``, or the
    model itself for the segment path); ``next()`` times one token."""

    def __init__(self, step, prompt):
        self.step, self.prompt = step, prompt
        self.restart()

    def restart(self) -> None:
        with torch.inference_mode():
            logits, self.cache = self.step(self.prompt, None)
        self.token = logits[:, -1:].argmax(-1)

    def next(self) -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits, self.cache = self.step(self.token, self.cache)
            self.token = logits[:, -1:].argmax(-1)
            return time.perf_counter() - t0


class CompiledStream(Stream):
    """The same greedy stream through ``decode.StaticDecoder(decoder, cache, compile=True)``: compiled once
    (at the first ``restart``), then loaded with each round's prompt cache."""

    decoder = None

    def restart(self) -> None:
        from mega_suite.models.megalodon import decode

        super().restart()
        if self.decoder is None:
            t0 = time.perf_counter()
            self.decoder = decode.StaticDecoder(self.step, self.cache, compile=True)
            print(f"  torch.compile of the static step: {time.perf_counter() - t0:.0f} s", flush=True)
        else:
            self.decoder.load(self.cache)
        self.token = self.token.view(-1)

    def next(self) -> float:
        t0 = time.perf_counter()
        self.token = self.decoder.step(self.token).argmax(-1)
        return time.perf_counter() - t0


def general_pass(model):
    """``model(tokens, cache)`` through the general streaming pass for every segment, single tokens included
    (the model's packed one-token step switched off: ``lm.STEP_TOKENS = 0`` during the call)."""
    from mega_suite.models.megalodon import lm

    def run(tokens, cache):
        saved, lm.STEP_TOKENS = lm.STEP_TOKENS, 0
        try:
            return model(tokens, cache, use_cache=True)
        finally:
            lm.STEP_TOKENS = saved

    return run


def port_side(path: str):
    """The port (``bench.peer.Side``: our config field by field, its own weights), or exit with why not."""
    from bench import peer

    if peer.peer_source(path) is None:
        sys.exit(
            f"--port {path!r}: no megalodon-hf checkout there (expected PATH/src/megalodon/modeling_megalodon.py); "
            "clone https://github.com/pszemraj/megalodon-hf and pass its path"
        )
    side = peer.Side("peer", path)
    side.model.eval()
    print(f"port: {peer.peer_source(path)} ({side.note})")
    return side


def ingest_rounds(ours, port, prompt, rounds: int) -> list[list[str]]:
    """Prompt ingest, ``ours`` (the suite's model) and the port alternating: the best of two per round."""
    rows = []
    with torch.inference_mode():
        for r in range(rounds):
            best = {}
            for _ in range(2):
                for name, fn in (
                    ("suite", lambda: ours(prompt, use_cache=True)),
                    ("port", lambda: port(prompt, None)),
                ):
                    best[name] = min(best.get(name, float("inf")), timed(fn))
            rows.append(
                [
                    str(r + 1),
                    f"{best['suite']:.3f}",
                    f"{best['port']:.3f}",
                    f"{best['suite'] / best['port']:.2f}",
                ]
            )
            print("  ingest " + " | ".join(rows[-1]), flush=True)
    return rows


def floors(numel: int) -> dict:
    """name -> a function reading ``numel`` weights once (one GEMV)."""
    rows = (numel + 1023) // 1024
    w = torch.randn(rows, 1024)
    wt = w.t().contiguous()
    x = torch.randn(1024)
    wb, xb, wtb = w.bfloat16(), x.bfloat16(), wt.bfloat16()
    w8 = torch.randint(-127, 128, (rows, 1024), dtype=torch.int8)
    s8 = torch.rand(rows, dtype=torch.bfloat16)
    return {
        "floor fp32 mv": lambda: torch.mv(w, x),
        "floor fp32 mv Wᵀ": lambda: torch.mv(wt.t(), x),
        "floor bf16 mv": lambda: torch.mv(wb, xb),
        "floor bf16 mv Wᵀ": lambda: torch.mv(wtb.t(), xb),
        "floor int8": lambda: torch.ops.aten._weight_int8pack_mm(xb[None], w8, s8),
    }


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def op_counts(stream: Stream) -> tuple[int, int]:
    """(top-level aten dispatches, profiler aten events with nested calls) of one token."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        stream.next()
    with torch.profiler.profile() as prof:
        stream.next()
    nested = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return Count.n, nested


def sweep(streams: dict, args) -> None:
    """``--sweep N``: each stream decodes N new positions after the prompt, as a long ``generate()`` would meet
    them (every attended length new, a bucket's first use included); the median and mean ms/token per 128
    positions. ``--order round-robin``: the streams take turns token by token (caches cold at every token);
    ``blocks``: each stream decodes 128 positions back to back, then the next one (caches as warm as in
    ``generate()``; the streams still alternate every 128 positions, so load drift reaches all alike)."""
    span = 128
    times = {name: [] for name in streams}
    for s in streams.values():
        s.restart()
    for lo in range(0, args.sweep, span):
        block = range(lo, min(args.sweep, lo + span))
        if args.order == "blocks":
            for name, s in streams.items():
                times[name] += [s.next() for _ in block]
        else:
            for _ in block:
                for name, s in streams.items():
                    times[name].append(s.next())
    rows = []
    for lo in range(0, args.sweep, span):
        hi = min(args.sweep, lo + span)
        rows.append([f"{args.prompt + lo}-{args.prompt + hi}"] + [
            f"{statistics.median(t[lo:hi]) * 1e3:.2f} / {statistics.mean(t[lo:hi]) * 1e3:.2f}"
            for t in times.values()
        ])  # fmt: skip
    print(
        f"\nGreedy decode, batch 1, {args.sweep} new tokens after a {args.prompt}-token prompt, "
        f"{args.threads} threads, the paths taking turns "
        f"{'every 128 tokens' if args.order == 'blocks' else 'token by token'}; ms per token, median / mean "
        f"per {span} positions:\n"
    )
    print(markdown_table(["positions", *streams], rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--order", choices=("round-robin", "blocks"), default="round-robin",
        help="paths take turns token by token (a load spike hits all alike; caches cold at every token) or "
        "decode --tokens tokens each, one path after the other (caches as warm as in generate())",
    )  # fmt: skip
    ap.add_argument(
        "--no-compile", action="store_true", help="leave out the compiled paths (compile 10-15 s each)"
    )
    ap.add_argument(
        "--sweep", type=int, default=0, metavar="N",
        help="instead of the rounds: every path decodes N new tokens from the prompt (taking turns as --order "
        "says: token by token, or every 128 tokens; no floors between them), and the table gives ms/token per "
        "128 positions",
    )  # fmt: skip
    ap.add_argument(
        "--port", default=None, metavar="PATH",
        help="a megalodon-hf checkout: the port's decode as path 'port', ratios to it, and prompt ingest beside it",
    )  # fmt: skip
    known = ["segment", "forward"] + [p[0] for p in PATHS] + ["port"]
    ap.add_argument(
        "--paths", default=None, help=f"comma list of the paths to time (default: all): {', '.join(known)}"
    )
    args = ap.parse_args(argv)
    default = [p for p in known if p != "port" or args.port]
    chosen = default if args.paths is None else [p.strip() for p in args.paths.split(",") if p.strip()]
    if "port" in chosen and not args.port:
        ap.error("--paths port needs --port PATH (a megalodon-hf checkout)")
    if args.port and "port" not in chosen:
        chosen.append("port")
    unknown = [p for p in chosen if p not in known]
    if unknown or not chosen:
        ap.error(f"--paths {args.paths!r}: unknown {unknown or 'none given'}; expected some of {known}")
    setup_threads(args.threads)
    print(f"# python -m bench.decode {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(machine_description(args.threads))
    from mega_suite import create_model
    from mega_suite.models.megalodon import decode

    torch.manual_seed(0)
    base = create_model("megalodon_cpu_bench").eval()
    prompt = torch.randint(0, base.cfg.vocab_size, (1, args.prompt))
    numel = sum(p.numel() for p in base.parameters())
    mkldnn = lambda dtype: decode.mkldnn_available(torch.device("cpu"), dtype)  # noqa: E731  (bf16: AVX-512)
    cannot = [
        name for name, dtype, gemv, compiled, _ in PATHS
        if name in chosen and ((gemv == "mkldnn" and not mkldnn(dtype)) or (compiled and args.no_compile))
    ]  # fmt: skip
    if args.paths is not None and cannot:
        sys.exit(f"--paths: {cannot} cannot run here (mkldnn unavailable for it, or --no-compile given)")
    paths = [p for p in PATHS if (p[2] != "mkldnn" or mkldnn(p[1])) and p[0] in chosen]
    streams = {"segment": Stream(general_pass(base), prompt)} if "segment" in chosen else {}
    if "forward" in chosen:  # its own copy: its own packed plan, as each decoder's
        own = copy.deepcopy(base)
        streams["forward"] = Stream(lambda tokens, cache: own(tokens, cache, use_cache=True), prompt)
    for name, dtype, gemv, compiled, kv_dtype in paths:
        if compiled and args.no_compile:
            continue
        decoder = decode.Decoder(copy.deepcopy(base), dtype, gemv, kv_dtype)
        streams[name] = (CompiledStream if compiled else Stream)(decoder, prompt)
    port = port_side(args.port) if "port" in chosen else None
    if port is not None:
        streams["port"] = Stream(port.stream, prompt)
    if args.sweep:
        sweep(streams, args)
        return
    reads = floors(numel)
    names = list(reads) + list(streams)
    rows, port_rows = [], []
    for r in range(args.rounds):
        times = collections.defaultdict(list)
        for s in streams.values():
            s.restart()
            for _ in range(3):  # warm-up: first-call allocations, plan packing
                s.next()
        for f in reads.values():
            f()
        if args.order == "blocks":  # each path decodes its tokens back to back, as generate() does
            for name, f in reads.items():
                times[name] += [timed(f) for _ in range(args.tokens)]
            for name, s in streams.items():
                times[name] += [
                    s.next() for _ in range(args.tokens // 4 if name == "segment" else args.tokens)
                ]
        else:
            for i in range(args.tokens):
                for name, f in reads.items():
                    times[name].append(timed(f))
                for name, s in streams.items():
                    if name != "segment" or i % 4 == 0:  # the slow path: every 4th turn
                        times[name].append(s.next())
        med = {n: statistics.median(times[n]) * 1e3 for n in names}
        floor = med["floor fp32 mv"]
        rows.append([str(r + 1)] + [f"{med[n]:.2f} ({med[n] / floor:.2f}x)" for n in names])
        print("  " + " | ".join(rows[-1]), flush=True)
        if port is not None:
            mine = [n for n in ("fp32 matmul", "forward", "segment") if n in med]
            port_rows.append(
                [str(r + 1), f"{med['port']:.2f}"]
                + [f"{med[n]:.2f} ({med[n] / med['port']:.2f})" for n in mine]
            )
    print(
        f"\nGreedy decode, batch 1, prompt {args.prompt}, {args.threads} threads, median ms per token over "
        f"{args.tokens} tokens per round (segment path: {args.tokens // 4}), {args.order}; in brackets: "
        "/ the fp32 mv floor of the same round:\n"
    )
    print(markdown_table(["round"] + names, rows))
    if port is not None:
        mine = [n for n in ("fp32 matmul", "forward", "segment") if n in streams]
        labels = {"fp32 matmul": "suite Decoder", "forward": "suite forward", "segment": "suite segment"}
        print(
            "\nThe suite beside the port, same rounds: ms per token (in brackets / the port's); suite Decoder = "
            "decode.Decoder(model), suite forward = model(tokens, cache), suite segment = the general streaming "
            "pass on one token:\n"
        )
        print(markdown_table(["round", "port"] + [labels[n] for n in mine], port_rows))
        print(
            f"\nPrompt ingest, {args.prompt} tokens in one streaming call, seconds (best of two per round):\n"
        )
        ingest = ingest_rounds(base, port.stream, prompt, args.rounds)
        print(markdown_table(["round", "suite s", "port s", "suite / port"], ingest))
    if args.profile:
        print("\naten ops per token (top-level dispatches / profiler events with nested calls):")
        for name, s in streams.items():
            top, nested = op_counts(s)
            print(f"  {name}: {top} / {nested}")
        first = next(iter(streams), None)
        if first is not None:
            with torch.profiler.profile() as prof:
                streams[first].next()
            print(f"\nprofile of one {first} step:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
