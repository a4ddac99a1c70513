"""One-token decode of a 7B-width Megalodon on a GPU against its HBM floor, with kernel launches counted.

    python -m bench.decode_gpu                          # megalodon_7b (32 layers), bf16 decode weights
    python -m bench.decode_gpu --layers 8 --tokens 16   # fewer layers: the same per-layer costs, less memory
    python -m bench.decode_gpu --device cpu --preset megalodon_cpu_bench --compile --threads 1   # CPU: no graphs
    python -m bench.decode_gpu --gemv mv,cublas,triton  # the compiled graph with each one-row GEMV, side by side
    python -m bench.decode_gpu --prompt 3000 --kv-dtype bfloat16   # late in a chunk, keys / values in bf16
    python -m bench.decode_gpu --gemv mv --compile-options '{"realize_opcount_threshold": 1}'   # + Inductor options

Measured in one process, after one prompt (reference kernels, so no Triton compile) of ``--prompt`` tokens:

- floors: the packed decode weights' bytes (bf16 packs, float32 head) over (a) the device-to-device copy
  bandwidth (bytes read + written over time, a 2 GiB copy) and (b) the bandwidth of one bf16 GEMV
  ``torch.mv`` over a [n, 4096] matrix of min(weights, 4 GiB) (scaled to the weights' bytes);
- ``eager``: ``decoder(token, cache)``, the one-token path of ``decode.block_step`` (host launches every op);
- ``static``: ``decode.StaticDecoder`` without graphs (fixed buffers, masked bucketed attention);
- ``static, torch.compile`` (``--compile``): the same step compiled by Inductor (fused elementwise ops);
- ``graph``: ``decode.StaticDecoder`` replaying one CUDA graph per token (CUDA only); with ``--compile`` also
  the graph of the compiled step (``StaticDecoder(compile=True)`` on CUDA: Inductor's kernels, captured).

``--gemv``: instead of the paths above, the CUDA graph of the compiled step once per one-row GEMV
(``decode.StaticDecoder(..., row_gemv=)``, the values of ``decode.CUDA_ROW_GEMV``), beside the eager path,
which gives the reference logits. "mm" (cuBLAS kept opaque) measured the same as "mv" in the second lease,
its prologues no longer fused (GPU_RESULTS.md); "cublas" has that structure with cuBLAS's GEMV kernel.
``--compile-options`` (a JSON dict of Inductor options): each GEMV's compiled graph also built with them,
beside Inductor's defaults (``StaticDecoder(..., compile_options=)``; on the CPU ``realize_opcount_threshold``
1 stopped the GEMV reductions recomputing their inputs' norms per output row, bench/reports/2026-11-24-compiled-cpu-decode-rows.md).

Per path: median ms/token (host clock after a device sync, per token), the ratio to each floor, and from
one profiled token the GPU kernels (plus memcpy / memset) it ran and the host-side launch calls it made
(``cudaLaunchKernel`` and friends, or one ``cudaGraphLaunch``). The graph's logits are checked against the
eager path's for the same token and cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import markdown_table

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
                "cudaMemsetAsync", "cudaGraphLaunch")  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device: torch.device, reps: int, warmup: int = 3) -> list[float]:
    """Wall ms of each call, synchronised before and after."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def count_launches(fn, device: torch.device) -> tuple[int, int, object]:
    """(device operations run, host launch calls, the profile) of one call of ``fn``, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return 0, 0, None
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    events = prof.events()
    on_device = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    host = sum(1 for e in events if e.name in LAUNCH_CALLS)
    return on_device, host, prof


def plan_bytes(plan) -> int:
    gemvs = [g for b in plan.blocks for g in (b.gemv_m, b.gemv_v, b.gemv_h2, b.gemv_13, b.gemv_2)] + [
        plan.head
    ]
    return sum(g.w.numel() * g.w.element_size() for g in gemvs)


def floors(nbytes: int, device: torch.device) -> dict[str, float]:
    """ms to read ``nbytes`` at the copy bandwidth and at one bf16 GEMV's bandwidth (measured here)."""
    copy_bytes = 2 * 2**30 if device.type == "cuda" else 2**28
    src = torch.randn(copy_bytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t_copy = statistics.median(time_ms(lambda: dst.copy_(src), device, 20))
    copy_bw = 2 * copy_bytes / (t_copy / 1e3)  # bytes read + written per second
    gemv_bytes = min(nbytes, 4 * 2**30 if device.type == "cuda" else 2**28)
    w = torch.randn(gemv_bytes // 2 // 4096, 4096, device=device, dtype=torch.bfloat16)
    x = torch.randn(4096, device=device, dtype=torch.bfloat16)
    t_mv = statistics.median(time_ms(lambda: torch.mv(w, x), device, 20))
    mv_bw = w.numel() * 2 / (t_mv / 1e3)
    return {"copy_bw": copy_bw, "mv_bw": mv_bw, "copy": nbytes / copy_bw * 1e3, "mv": nbytes / mv_bw * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="megalodon_7b")
    ap.add_argument("--layers", type=int, default=None, help="override num_layers (default: the preset's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=24, help="timed tokens per path")
    ap.add_argument("--weights", choices=["bfloat16", "float32", "int8"], default="bfloat16")
    ap.add_argument(
        "--kv-dtype", choices=["as-computed", "float32", "bfloat16"], default="as-computed",
        help="the chunk's cached keys / values while decoding (decode.Decoder's kv_dtype; as-computed: "
        "float32 after this float32 prompt); they are read every token, beside the weights",
    )  # fmt: skip
    ap.add_argument(
        "--compile", action="store_true", help="add the static step compiled by torch.compile (Inductor)"
    )
    ap.add_argument(
        "--profile", type=int, default=0, help="CUDA: the top N kernels of each path by device time"
    )
    ap.add_argument(
        "--gemv", default=None,
        help="comma-separated one-row CUDA GEMVs (decode.CUDA_ROW_GEMVS: mv, mm, cublas, triton) to time side "
        "by side, each as the CUDA graph of the compiled step (implies --compile; the eager path is kept as "
        "the logits reference, the other paths are left out)",
    )  # fmt: skip
    ap.add_argument(
        "--compile-options", default=None, metavar="JSON",
        help='Inductor options, e.g. \'{"realize_opcount_threshold": 1}\': with --gemv, each variant is also '
        "compiled with them, beside Inductor's defaults",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    variants = [v.strip() for v in args.gemv.split(",") if v.strip()] if args.gemv else []
    option_sets = [{}]  # {}: Inductor's defaults
    if args.compile_options is not None:
        try:
            extra = json.loads(args.compile_options)
        except json.JSONDecodeError as err:
            ap.error(f"--compile-options {args.compile_options!r}: not JSON ({err})")
        if not isinstance(extra, dict) or not extra:
            ap.error(f"--compile-options {args.compile_options!r}: expected a non-empty JSON object")
        if not variants:
            ap.error("--compile-options needs --gemv (the compiled graphs it is compared in)")
        option_sets.append(extra)
    if variants:
        from mega_suite.models.megalodon.decode import CUDA_ROW_GEMVS

        bad = [v for v in variants if v not in CUDA_ROW_GEMVS]
        if bad:
            ap.error(f"--gemv: {bad} not in {CUDA_ROW_GEMVS}")
        if device.type != "cuda":  # a smoke run of this code path: every variant is torch.mv on the CPU
            print("--gemv on the CPU: every variant runs torch.mv (a smoke test of the bench)", flush=True)
        from kernels import dispatch as kernel_dispatch

        if "triton" in variants and kernel_dispatch.reference_forced():
            ap.error("--gemv triton: the Triton kernels are switched off (MEGA_SUITE_KERNELS=reference)")
        args.compile = True
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.decode_gpu: no CUDA device here (use --device cpu for a smoke test)", file=sys.stderr)
        return 2

    from kernels import dispatch
    from mega_suite.models import count_parameters, create_model
    from mega_suite.models.megalodon import decode

    overrides = {} if args.layers is None else {"num_layers": args.layers}
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = create_model(args.preset, device=device, **overrides).eval()
    kv_dtype = None if args.kv_dtype == "as-computed" else getattr(torch, args.kv_dtype)
    decoder = decode.Decoder(model, getattr(torch, args.weights), kv_dtype=kv_dtype)
    n_params = count_parameters(model)
    g = torch.Generator().manual_seed(1)
    vocab = model.cfg.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=g).to(device)
    steps = torch.randint(0, vocab, (5 * args.tokens + 30,), generator=g).to(device)
    dispatch.force_reference(True)  # the prompt pass: PyTorch kernels, no Triton autotune compile
    with torch.no_grad():
        _, cache = decoder(prompt)
        plan = decoder.plan()
    dispatch.force_reference(None)
    nbytes = plan_bytes(plan)
    cfg = model.cfg  # keys and values of the unfinished chunk, read by every decoded token
    kv_rows = args.prompt % cfg.chunk_size
    kv_item = 2 if args.kv_dtype == "bfloat16" else 4
    kv_bytes = kv_rows * cfg.num_layers * (cfg.z_dim + cfg.value_dim) * kv_item
    print(f"model {args.preset} ({n_params / 1e9:.2f}B params, {model.cfg.num_layers} layers) and plan built "
          f"in {time.perf_counter() - t0:.0f} s; decode weights {nbytes / 1e9:.2f} GB", flush=True)  # fmt: skip
    fl = floors(nbytes, device)
    print(f"copy {fl['copy_bw'] / 1e12:.2f} TB/s (r+w), bf16 GEMV {fl['mv_bw'] / 1e12:.2f} TB/s", flush=True)

    rows, it, profiles = [], iter(steps), ""

    def eager_step():
        nonlocal cache
        with torch.no_grad():
            logits, cache = decoder(next(it).view(1, 1), cache)
        return logits

    first = steps[:1]
    if variants:  # one compiled graph per GEMV (each decoder sets its GEMV around its compile and steps)
        static = graphs = compiled_graphs = None
        per_gemv = {}
        for v in variants:
            for opts in option_sets:
                label = f"GEMV {v}" + (f", options {json.dumps(opts)}" if opts else "")
                t_c = time.perf_counter()
                dec = decode.StaticDecoder(decoder, cache, compile=True, row_gemv=v, compile_options=opts)
                per_gemv[label] = (dec, dec.step(first).clone())  # captures the first bucket's graph
                print(f"{label}: compiled and captured in {time.perf_counter() - t_c:.0f} s", flush=True)
    else:
        static = decode.StaticDecoder(decoder, cache, buckets=8, graphs=False)  # the graph path's buckets
        graphs = decode.StaticDecoder(decoder, cache) if device.type == "cuda" else None
        # CUDA and --compile: Inductor's fused kernels, captured (fewer kernels per graph)
        compiled_graphs = (
            decode.StaticDecoder(decoder, cache, compile=True) if graphs and args.compile else None
        )
    # Same token, same state: each graph's logits against the eager path's (before any path advances).
    check = ""
    if device.type == "cuda":
        with torch.no_grad():
            want, _ = decoder(first.view(1, 1), cache)
        got = {f"compiled graph, {v}": logits for v, (_, logits) in per_gemv.items()} if variants else {
            name: dec.step(first) for name, dec in (("graph", graphs), ("compiled graph", compiled_graphs)) if dec
        }  # fmt: skip
        for name, logits in got.items():
            err = float((logits - want[:, 0]).abs().max() / want.abs().max())
            check += f"{name} vs eager logits, same token and cache: max|diff| / max|eager| = {err:.1e}\n"
        if static is not None:
            static.step(first)
        print(check, flush=True)
        eager_step()  # the eager cache takes the same token
    paths = [("eager (block_step)", eager_step)]
    if variants:
        for v, (dec, _) in per_gemv.items():
            label = "CUDA graph of the compiled step" if device.type == "cuda" else "compiled step"
            paths.append((f"{label}, {v}", lambda dec=dec: dec.step(next(it))))
    else:
        paths.append(("static, no graph", lambda: static.step(next(it))))
    if args.compile and not variants:
        # one Inductor graph, the attended length dynamic, compiled in the constructor
        t_c = time.perf_counter()
        compiled = decode.StaticDecoder(decoder, cache, graphs=False, compile=True)
        print(f"torch.compile of the static step: {time.perf_counter() - t_c:.0f} s", flush=True)
        paths.append(("static, torch.compile", lambda: compiled.step(next(it))))
    if graphs is not None:
        paths.append(("CUDA graph (StaticDecoder)", lambda: graphs.step(next(it))))
    if compiled_graphs is not None:
        paths.append(("CUDA graph of the compiled step", lambda: compiled_graphs.step(next(it))))
    for name, fn in paths:
        ms = time_ms(fn, device, args.tokens)
        kernels, launches, prof = count_launches(fn, device)
        if args.profile and prof is not None:
            from bench.diagnostics.gpu_profile import kernel_rows

            krows, total, _ = kernel_rows(prof, args.profile)
            profiles += f"\n### {name}: {total:.2f} ms of kernels per token\n\n"
            profiles += markdown_table(["kernel", "calls", "ms", "share"], krows) + "\n"
        med = statistics.median(ms)
        rows.append([name, f"{med:.2f}", f"{min(ms):.2f}", f"{med / fl['copy']:.2f}", f"{med / fl['mv']:.2f}",
                     kernels or "-", launches or "-"])  # fmt: skip
        print(" | ".join(map(str, rows[-1])), flush=True)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    head = (
        f"{args.preset}, {model.cfg.num_layers} layers, {n_params / 1e9:.2f}B parameters, {args.weights} decode "
        f"weights ({nbytes / 1e9:.2f} GB read per token), batch 1, prompt {args.prompt}, {args.tokens} timed "
        f"tokens per path; cached keys and values {args.kv_dtype}, {kv_bytes / 1e9:.3f} GB read per token at "
        f"the prompt's end (not in the floors); {name}, torch {torch.__version__}. Floors: the weights at the "
        "measured copy bandwidth "
        f"({fl['copy_bw'] / 1e12:.2f} TB/s read + written) = {fl['copy']:.2f} ms; at one bf16 GEMV's bandwidth "
        f"({fl['mv_bw'] / 1e12:.2f} TB/s) = {fl['mv']:.2f} ms.\n\n"
    )
    table = markdown_table(
        ["path", "ms/token (median)", "min", "/ copy floor", "/ GEMV floor", "device ops per token",
         "host launch calls per token"], rows)  # fmt: skip
    text = head + table + ("\n\n" + check.strip() if check else "") + "\n" + profiles
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
