"""The brief's CPU bar: training throughput, peak memory and streaming decode of ``megalodon_cpu_bench``.

    python -m bench.cpu_bar                        # L = 2K..32K, with/without checkpointing, decode
    python -m bench.cpu_bar --quick                # L = 2K only, one timed step, 50 decode tokens
    python -m bench.cpu_bar --glibc-no-mmap        # full run, malloc keeps freed blocks (bench/reports/2026-11-22-cpu-baseline.md)
    python -m bench.cpu_bar --lengths 2K,4K --no-checkpointing
    python -m bench.cpu_bar --profile 4K           # only: torch.profiler breakdown of one training step
    python -m bench.cpu_bar --precision bf16-mixed --lengths 2K,4K,8K   # bf16 autocast beside fp32

Model: the ``megalodon_cpu_bench`` preset (4 layers, D 512, Z 128, E 1024, FFN 1024 SwiGLU, V 512, C 2048,
14.6M parameters), fp32, batch 1, 2 threads. Training step = forward, cross-entropy on next tokens,
backward, AdamW step, gradients reset to None; tokens/s = L / step time (best of ``--repeat`` after one
warm-up step). Each configuration runs in a fresh process; memory is the process's peak RSS (VmHWM:
Python, torch, model, AdamW state, activations) and, as "delta", that peak minus the RSS after the model
and optimizer were built (see ``bench/common.py``).

``--precision bf16-mixed`` also runs every training configuration under ``torch.autocast("cpu", bf16)``
(the suite's bf16-mixed: float32 weights and islands, bf16 Linear layers and attention) and prints it
beside fp32, with its share of the bf16 matmul peak (this CPU has AVX512-BF16).

Decode: a prompt through the streaming cache, then one token at a time (greedy) through
``decode.Decoder(model)(token, cache)``; median wall time per token.

Baseline: the public pure-PyTorch port's published CPU figures (constants below), next to our targets.
Achieved GFLOP/s counts model matmul FLOPs analytically (see ``training_flops``) against the fp32 peak of
one large ``torch.mm`` measured here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/cpu_bar.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from bench.common import (
    GLIBC_NO_MMAP,
    GiB,
    Measurement,
    fmt_bytes,
    fmt_length,
    fmt_ratio,
    machine_description,
    markdown_table,
    measure,
    met,
    parse_lengths,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    run_isolated,
    setup_threads,
    use_glibc_no_mmap,
)

PRESET = "megalodon_cpu_bench"

# The public pure-PyTorch port's published CPU figures (same model, fp32, batch 1, 2 threads).
BASELINE_TOKENS_PER_S = {2048: 357.0, 4096: 302.0, 8192: 235.0}  # 16K: not trainable without checkpointing
BASELINE_PEAK_GB = {2048: 4.0, 4096: 7.0, 8192: 11.8}
BASELINE_DECODE_MS = 9.5
# Our targets relative to it.
TARGET_SPEEDUP = 3.0  # training tokens/s >= 3x the port's
TARGET_MEM_FRACTION = 0.25  # peak memory <= 1/4 of the port's
TARGET_32K_GB = 12.0  # L = 32K trainable within this peak
TARGET_DECODE_MS = 4.0


def build_model(checkpointing: bool):
    from mega_suite import create_model

    torch.manual_seed(0)
    model = create_model(PRESET)
    model.gradient_checkpointing = checkpointing
    return model


def training_flops(model, length: int) -> tuple[float, str]:
    """Matmul FLOPs of one training step (forward + backward), analytically.

    6 * P * L for the dense layers (P = weights of every nn.Linear, output head included, embedding
    excluded: 2 FLOPs per weight per token forward, 4 backward), plus per layer for the chunked causal
    attention 3 * L * C' * (Z + E) with C' = min(C, L): per chunk Q K^T costs 2 C^2 Z and P V 2 C^2 E,
    halved by the causal mask, and backward costs twice the forward. CEMA (FFT), norms and elementwise
    work are not counted, nor checkpointing's recomputation (model FLOPs, not hardware FLOPs).
    """
    cfg = model.cfg
    dense = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = min(cfg.chunk_size, length)
    attn = cfg.num_layers * 3 * length * c * (cfg.z_dim + cfg.value_dim)
    total = 6 * dense * length + attn
    formula = (
        f"6 * {dense / 1e6:.2f}M (Linear weights incl. head) * L + {cfg.num_layers} layers * "
        f"3 * L * min(C, L) * (Z + E = {cfg.z_dim + cfg.value_dim})"
    )
    return float(total), formula


def matmul_peak_gflops(n: int = 4096, repeat: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of the best of ``repeat`` [n, n] @ [n, n] products in ``dtype``."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def bench_train(
    length: int, checkpointing: bool, warmup: int, repeat: int, precision: str = "32-true"
) -> Measurement:
    """In a fresh process: one AdamW training step on [1, L] random tokens (bf16-mixed: under autocast)."""
    import contextlib

    def autocast():
        if precision == "bf16-mixed":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def build():
        model = build_model(checkpointing)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        tokens = torch.randint(0, model.cfg.vocab_size, (1, length + 1))
        return model, opt, tokens

    def step_of(state):
        model, opt, tokens = state

        def step():
            with autocast():
                logits, _ = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    m = measure(build, step_of, warmup, repeat)
    model = build_model(False)
    m.extra["params"] = sum(p.numel() for p in model.parameters())
    m.extra["flops"], m.extra["formula"] = training_flops(model, length)
    return m


def bench_decode(prompt_len: int, new_tokens: int) -> Measurement:
    """In a fresh process: prompt through the cache, then ``new_tokens`` greedy steps of one token."""
    from mega_suite.models.megalodon.decode import Decoder

    model = build_model(False).eval()
    decoder = Decoder(model)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, prompt_len))
    baseline = rss_bytes()
    reset_peak_rss()
    times = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits, cache = decoder(prompt)
        prefill = time.perf_counter() - t0
        token = logits[:, -1:].argmax(-1)
        for _ in range(new_tokens):
            t0 = time.perf_counter()
            logits, cache = decoder(token, cache)
            token = logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
    return Measurement(
        times=times,
        baseline_bytes=baseline,
        peak_bytes=peak_rss_bytes(),
        extra={"prefill_s": prefill, "cache_bytes": cache.memory_bytes(), "position": cache.position},
    )


# --------------------------------------------------------------------------- profile


def profile_step(length: int, checkpointing: bool, top: int) -> None:
    """Where the time of one training step goes: torch.profiler self CPU time by op, and by component."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import mega_suite.models.megalodon.attention as mm  # the attention layer's namespace: rope, chunk_attention
    from mega_suite.models.megalodon.block import NormalizedFFN

    model = build_model(checkpointing).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, length + 1))

    # Forward ranges per component: hooks on the modules, wrappers on the functions the block calls.
    def hook_range(module, name):
        ctx = {}
        module.register_forward_pre_hook(lambda *_: ctx.__setitem__("r", record_function(name).__enter__()))
        module.register_forward_hook(lambda *_: ctx.pop("r").__exit__(None, None, None))

    for mod in model.modules():
        if isinstance(mod, mm.TimestepNorm | mm.ComplexEMA | NormalizedFFN | mm.RMSNorm):
            hook_range(mod, f"fwd {type(mod).__name__}")
    hook_range(model.output.output, "fwd output projection")
    for fname in ("rope", "chunk_attention"):
        if not hasattr(mm, fname):
            continue
        orig = getattr(mm, fname)

        def wrapped(*a, _orig=orig, _name=fname, **k):
            with record_function(f"fwd {_name}"):
                return _orig(*a, **k)

        setattr(mm, fname, wrapped)
    orig_qkv = getattr(mm.MegalodonAttention, "_qkv", None)
    if orig_qkv is not None:

        def qkv(self, *a, **k):
            with record_function("fwd _qkv (wz, wv, wr, Q/K norm)"):
                return orig_qkv(self, *a, **k)

        mm.MegalodonAttention._qkv = qkv

    def step():
        with record_function("forward"):
            logits, _ = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    step()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    print(f"\nProfile of one training step, L = {fmt_length(length)}, checkpointing={checkpointing}: "
          f"wall {wall:.2f} s (profiled), total self CPU {total / 1e6:.2f} s\n")  # fmt: skip
    by_name = {e.key: e for e in events}
    phases = [
        [k, f"{by_name[k].cpu_time_total / 1e6:.2f} s"]
        for k in ("forward", "backward", "optimizer")
        if k in by_name
    ]
    print(markdown_table(["phase", "CPU time (incl. children)"], phases))

    ops = sorted((e for e in events if not e.key.startswith(("fwd ", "forward", "backward", "optimizer"))),
                 key=lambda e: e.self_cpu_time_total, reverse=True)  # fmt: skip
    rows = [
        [
            e.key,
            f"{e.self_cpu_time_total / 1e6:.3f} s",
            f"{100 * e.self_cpu_time_total / total:.1f}%",
            str(e.count),
        ]
        for e in ops[:top]
    ]
    print(f"\nTop {top} ops by self CPU time (share of the step's total self CPU time):\n")
    print(markdown_table(["op", "self CPU", "share", "calls"], rows))

    comps = sorted(
        (e for e in events if e.key.startswith("fwd ")), key=lambda e: e.cpu_time_total, reverse=True
    )
    fwd = by_name["forward"].cpu_time_total if "forward" in by_name else total
    print("\nForward time by component (CPU time incl. children; share of the forward):\n")
    print(markdown_table(
        ["component", "CPU time", "share of forward", "calls"],
        [[e.key[4:], f"{e.cpu_time_total / 1e6:.3f} s", f"{100 * e.cpu_time_total / fwd:.1f}%", str(e.count)] for e in comps],
    ))  # fmt: skip

    bwd_nodes = sorted((e for e in events if e.key.startswith("autograd::engine::evaluate_function: ")),
                       key=lambda e: e.cpu_time_total, reverse=True)  # fmt: skip
    bwd = by_name["backward"].cpu_time_total if "backward" in by_name else total
    print(f"\nTop {top} backward nodes (CPU time incl. children; share of the backward):\n")
    print(markdown_table(
        ["autograd node", "CPU time", "share of backward", "calls"],
        [[e.key.split(": ", 1)[1], f"{e.cpu_time_total / 1e6:.3f} s", f"{100 * e.cpu_time_total / bwd:.1f}%", str(e.count)]
         for e in bwd_nodes[:top]],
    ))  # fmt: skip


# --------------------------------------------------------------------------- main


def print_precision_table(lengths, modes, res, res_bf16, peak: float, peak_bf16: float) -> None:
    """bf16-mixed beside fp32, measured in the same run (each configuration in a fresh process)."""
    print(
        "\nbf16-mixed (torch.autocast cpu bf16: bf16 Linear layers and attention, float32 weights, CEMA, norms "
        f"and logits) beside fp32. Matmul peaks measured in this run: fp32 {peak:.0f}, bf16 {peak_bf16:.0f} "
        f"GFLOP/s ({peak_bf16 / peak:.2f}x). % of peak = model matmul FLOP/s / that precision's peak.\n"
    )
    rows = []
    for length in lengths:
        for ckpt in modes:
            a, b = res[length, ckpt], res_bf16[length, ckpt]
            if not (a.ok and b.ok):
                rows.append([fmt_length(length), "on" if ckpt else "off"] + [a.status, b.status] + ["-"] * 6)
                continue
            flops = a.extra["flops"]
            rows.append([
                fmt_length(length), "on" if ckpt else "off", f"{length / a.best:.0f}", f"{length / b.best:.0f}",
                fmt_ratio(a.best / b.best), fmt_bytes(a.peak_bytes), fmt_bytes(b.peak_bytes),
                fmt_ratio(b.peak_bytes / a.peak_bytes), f"{100 * flops / a.best / 1e9 / peak:.0f}%",
                f"{100 * flops / b.best / 1e9 / peak_bf16:.0f}%",
            ])  # fmt: skip
    print(markdown_table(
        ["L", "ckpt", "fp32 tok/s", "bf16-mixed tok/s", "bf16 speed-up", "fp32 peak RSS", "bf16 peak RSS",
         "bf16 / fp32 mem", "fp32 % of fp32 peak", "bf16 % of bf16 peak"],
        rows,
    ))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--lengths",
        default=None,
        help="comma list (default 2K,4K,8K,16K,32K; --quick: 2K), e.g. 2K,4K,16384",
    )
    ap.add_argument("--no-checkpointing", action="store_true", help="skip the activation-checkpointing runs")
    ap.add_argument("--decode-only", action="store_true", help="only the streaming-decode measurement")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2, help="timed steps (best is reported)")
    ap.add_argument("--decode-prompt", type=int, default=1024, help="prompt length before decoding")
    ap.add_argument(
        "--decode-tokens", type=int, default=None, help="tokens decoded one at a time (200; --quick: 50)"
    )
    ap.add_argument("--mem-cap-gb", type=float, default=18.0, help="abort a run whose RSS exceeds this")
    ap.add_argument("--profile", default=None, help="only profile one training step at this L (e.g. 4K)")
    ap.add_argument("--profile-checkpointing", action="store_true", help="profile with checkpointing on")
    ap.add_argument("--top", type=int, default=20, help="rows of the profile tables")
    ap.add_argument(
        "--glibc-no-mmap",
        action="store_true",
        help=f"run the measurements with GLIBC_TUNABLES={GLIBC_NO_MMAP}",
    )
    ap.add_argument("--quick", action="store_true", help="L = 2K, one timed step, 50 decode tokens")
    ap.add_argument(
        "--precision",
        choices=("32-true", "bf16-mixed"),
        default="32-true",
        help="bf16-mixed: also train under bf16 autocast and print it beside fp32",
    )
    args = ap.parse_args()
    if args.quick:
        args.repeat = 1
    if args.decode_tokens is None:
        args.decode_tokens = 50 if args.quick else 200
    if args.lengths is None:
        args.lengths = "2K" if args.quick else "2K,4K,8K,16K,32K"
    setup_threads()
    if args.glibc_no_mmap:
        use_glibc_no_mmap()
    print(f"# bench/cpu_bar.py  ({' '.join(sys.argv[1:]) or 'defaults'})")
    print(machine_description())
    if args.profile:
        profile_step(parse_lengths(args.profile)[0], args.profile_checkpointing, args.top)
        return

    lengths = [] if args.decode_only else parse_lengths(args.lengths)
    peak = matmul_peak_gflops()
    print(f"fp32 matmul peak (best 4096^3 torch.mm, 2 threads): {peak:.0f} GFLOP/s", flush=True)
    bf16 = args.precision == "bf16-mixed"
    peak_bf16 = matmul_peak_gflops(dtype=torch.bfloat16) if bf16 else None
    if bf16:
        print(f"bf16 matmul peak (best 4096^3 torch.mm, 2 threads): {peak_bf16:.0f} GFLOP/s", flush=True)
    modes = [False] if args.no_checkpointing else [False, True]
    res: dict[tuple[int, bool], Measurement] = {}
    res_bf16: dict[tuple[int, bool], Measurement] = {}
    precisions = {"32-true": res, "bf16-mixed": res_bf16} if bf16 else {"32-true": res}
    for length in lengths:
        for ckpt in modes:
            for precision, results in precisions.items():  # alternating: the two are measured side by side
                m = run_isolated(
                    bench_train,
                    args.mem_cap_gb,
                    length=length,
                    checkpointing=ckpt,
                    warmup=args.warmup,
                    repeat=args.repeat,
                    precision=precision,
                )
                results[length, ckpt] = m
                shown = (
                    f"{length / m.best:.0f} tok/s (best of {len(m.times)}), peak {fmt_bytes(m.peak_bytes)}, "
                    f"CPU util {m.cpu_utilisation:.2f}"
                    if m.ok
                    else f"{m.status} {m.message}"
                )
                print(f"  train L={fmt_length(length):>4s} ckpt={ckpt!s:5s} {precision}: {shown}", flush=True)
    dec = run_isolated(
        bench_decode, args.mem_cap_gb, prompt_len=args.decode_prompt, new_tokens=args.decode_tokens
    )

    if lengths:
        first = next((m for m in res.values() if m.ok), None)
        if first is not None:
            print(
                f"\nModel {PRESET}: {first.extra['params'] / 1e6:.2f}M parameters. FLOPs per step: {first.extra['formula']}."
            )
        print(
            f"Best of {args.repeat} steps after {args.warmup} warm-up. Memory: peak RSS of a fresh process (VmHWM, whole "
            "process) and delta = peak minus RSS after building model + optimizer. Baseline = the public port's "
            f"published figures; targets: >= {TARGET_SPEEDUP:g}x its tokens/s, <= {TARGET_MEM_FRACTION:g} of its peak, "
            f"32K in <= {TARGET_32K_GB:g} GB. CPU util = CPU s / wall s (2.0 = both cores busy); "
            "sys = share of that CPU time spent in the kernel (page faults on re-allocated activations).\n"
        )
        rows = []
        for length in lengths:
            for ckpt in modes:
                m = res[length, ckpt]
                base_tps, base_gb = BASELINE_TOKENS_PER_S.get(length), BASELINE_PEAK_GB.get(length)
                if not m.ok:
                    rows.append([fmt_length(length), "on" if ckpt else "off", m.status] + ["-"] * 11)
                    continue
                tps = length / m.best
                gflops = m.extra["flops"] / m.best / 1e9
                speedup = tps / base_tps if base_tps else None
                mem_frac = m.peak_bytes / GiB / base_gb if base_gb else None
                base_cell = (
                    f"{base_tps:.0f} tok/s, {base_gb:g} GB"
                    if base_tps
                    else ("not trainable" if not ckpt and length == 16384 else "-")
                )
                if speedup is not None:
                    verdict = (
                        f"speed {met(speedup >= TARGET_SPEEDUP)}, mem {met(mem_frac <= TARGET_MEM_FRACTION)}"
                    )
                elif length == 32768:
                    verdict = f"32K in <= {TARGET_32K_GB:g} GB {met(m.peak_bytes / GiB <= TARGET_32K_GB)}"
                else:
                    verdict = "-"
                rows.append([
                    fmt_length(length), "on" if ckpt else "off", f"{m.best:.2f} s", f"{tps:.0f}", fmt_bytes(m.peak_bytes),
                    fmt_bytes(m.delta_bytes), base_cell, fmt_ratio(speedup), fmt_ratio(mem_frac), verdict,
                    f"{gflops:.0f}", f"{100 * gflops / peak:.0f}%", f"{m.cpu_utilisation:.2f}", f"{100 * m.sys_share:.0f}%",
                ])  # fmt: skip
        print(markdown_table(
            ["L", "ckpt", "step", "tok/s", "peak RSS", "delta", "baseline (port)", "speed x port", "mem / port",
             "targets", "GFLOP/s", "% of mm peak", "CPU util", "sys"],
            rows,
        ))  # fmt: skip

    if res_bf16:
        print_precision_table(lengths, modes, res, res_bf16, peak, peak_bf16)

    print(
        f"\nStreaming decode, batch 1, greedy, prompt {args.decode_prompt} tokens then {args.decode_tokens} single-token steps:\n"
    )
    if dec.ok:
        qs = statistics.quantiles(dec.times, n=10)
        ms = dec.median * 1e3
        print(markdown_table(
            ["median ms/token", "p10 / p90 ms", "prefill", "cache", "peak RSS", "baseline (port)", "ratio", f"target <= {TARGET_DECODE_MS:g} ms"],
            [[f"{ms:.2f}", f"{qs[0] * 1e3:.2f} / {qs[-1] * 1e3:.2f}", f"{dec.extra['prefill_s']:.2f} s",
              f"{dec.extra['cache_bytes'] / 2**20:.1f} MiB", fmt_bytes(dec.peak_bytes), f"{BASELINE_DECODE_MS:g} ms",
              fmt_ratio(ms / BASELINE_DECODE_MS), met(ms <= TARGET_DECODE_MS)]],
        ))  # fmt: skip
    else:
        print(f"decode run failed: {dec.status} {dec.message}")


if __name__ == "__main__":
    main()
