"""CEMA methods on CPU: forward + backward time and peak memory across L, and float32 accuracy.

    python -m bench.cema                     # L = 1K..32K, errors at L = 4096, TimestepNorm at L = 65536
    python -m bench.cema --quick             # L = 1K, 2K; errors at L = 1024; TimestepNorm at L = 8192
    python -m bench.cema --glibc-no-mmap     # full run, malloc keeps freed blocks (bench/reports/2026-11-22-cpu-baseline.md)
    python -m bench.cema --lengths 1K,4K --seq-max 1024

Timing: ``kernels.cema.cema`` with method "sequential" (the step-by-step recurrence, capped at
``--seq-max`` because its cost is thousands of tiny ops), "fft" and "chunked", D 512, N 16, B 1, fp32,
parameters initialised as ``ComplexEMA`` does. One step = raw parameters -> coefficients -> CEMA ->
backward of a random cotangent into x and every parameter. Ratios are against "fft" (what "auto" picks
for training). Each cell runs in a fresh process (peak memory, see ``bench/common.py``).

Accuracy: relative error ||y32 - y64|| / ||y64|| (and the same for dx) of each method run in float32,
against the float64 step-by-step recurrence on the same (float32-representable) inputs and parameters.
TimestepNorm: float32 ``timestep_norm`` on x ~ N(100, 1), L = 65536, D 512, G 64, against an
independent float64 computation of the causal group statistics.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/cema.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import (
    GLIBC_NO_MMAP,
    Measurement,
    fmt_bytes,
    fmt_length,
    fmt_ratio,
    fmt_time,
    machine_description,
    markdown_table,
    measure,
    met,
    parse_lengths,
    run_isolated,
    setup_threads,
    use_glibc_no_mmap,
)

METHODS = ("sequential", "fft", "chunked")
TARGET_REL_ERR = 1e-5
DIM, NDIM, GROUPS = 512, 16, 64


def make_cema_module(dtype: torch.dtype = torch.float32):
    from mega_suite.models.megalodon.layers import ComplexEMA

    torch.manual_seed(0)
    return ComplexEMA(DIM, NDIM).to(dtype)


def cema_forward(module, x: torch.Tensor, method: str) -> torch.Tensor:
    from kernels.cema import cema, cema_coefficients

    p, q, gamma = cema_coefficients(module.alpha, module.delta, module.theta, module.gamma)
    y, _ = cema(x, p, q, gamma, module.omega.squeeze(-1), method=method)
    return y


def bench_cema(method: str, length: int, warmup: int, repeat: int) -> Measurement:
    """In a fresh process: coefficients + CEMA forward + backward, [1, L, 512] fp32."""

    def build():
        module = make_cema_module()
        x = torch.randn(1, length, DIM, requires_grad=True)
        return module, x, torch.randn(1, length, DIM)

    def step_of(state):
        module, x, cotangent = state

        def step():
            cema_forward(module, x, method).backward(cotangent)
            x.grad = None
            module.zero_grad(set_to_none=True)

        return step

    return measure(build, step_of, warmup, repeat)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def cema_errors(length: int) -> list[list[str]]:
    """float32 methods vs the float64 recurrence: relative errors of y and of dL/dx."""
    m32 = make_cema_module(torch.float32)
    m64 = make_cema_module(torch.float64)
    m64.load_state_dict({k: v.double() for k, v in m32.state_dict().items()})
    torch.manual_seed(1)
    x32 = torch.randn(1, length, DIM)
    cot = torch.randn(1, length, DIM, dtype=torch.float64)

    def run(module, x, method):
        x = x.clone().requires_grad_(True)
        y = cema_forward(module, x, method)
        y.backward(cot.to(y.dtype))
        return y.detach(), x.grad

    y_ref, g_ref = run(m64, x32.double(), "sequential")
    rows = []
    for method in METHODS:
        y64, g64 = run(m64, x32.double(), method)
        y, g = run(m32, x32, method)
        ey, eg = rel_err(y, y_ref), rel_err(g, g_ref)
        rows.append([
            method, f"{ey:.2e}", f"{eg:.2e}", f"{rel_err(y64, y_ref):.1e}", met(max(ey, eg) <= TARGET_REL_ERR),
        ])  # fmt: skip
    return rows


def timestep_norm_error(length: int) -> list[list[str]]:
    """float32 TimestepNorm on x ~ N(100, 1) vs an independent float64 causal group normalisation."""
    from kernels.timestep_norm import timestep_norm

    torch.manual_seed(2)
    x = 100.0 + torch.randn(1, length, DIM)
    weight, bias = torch.zeros(DIM), torch.zeros(DIM)
    # Reference in float64: cumulative first and second moments of x - 100 (exact enough in float64).
    xg = (x.double() - 100.0).reshape(1, length, GROUPS, DIM // GROUPS)
    n = torch.arange(1, length + 1, dtype=torch.float64).view(1, length, 1)
    mean = xg.mean(-1).cumsum(1) / n
    var = xg.square().mean(-1).cumsum(1) / n - mean.square()
    ref = ((xg - mean.unsqueeze(-1)) * torch.rsqrt(var + 1e-5).unsqueeze(-1)).reshape(1, length, DIM)

    y32, state = timestep_norm(x, weight, bias, GROUPS, 1e-5)
    y64, _ = timestep_norm(x.double(), weight.double(), bias.double(), GROUPS, 1e-5)
    # What a plain float32 cumulative sum gives (the failure mode the kernel's shift + float64 sums avoid).
    xg32 = x.reshape(1, length, GROUPS, DIM // GROUPS)
    n32 = n.float()
    mean32 = xg32.mean(-1).cumsum(1) / n32
    var32 = (xg32.square().mean(-1).cumsum(1) / n32 - mean32.square()).clamp(min=0)
    naive = ((xg32 - mean32.unsqueeze(-1)) * torch.rsqrt(var32 + 1e-5).unsqueeze(-1)).reshape(1, length, DIM)
    e32, e_last_mean = rel_err(y32, ref), (state[1].double() - (mean[:, -1] + 100)).abs().max().item()
    return [
        ["timestep_norm, float32", f"{e32:.2e}", f"{e_last_mean:.1e}", met(e32 <= TARGET_REL_ERR)],
        ["timestep_norm, float64", f"{rel_err(y64, ref):.1e}", "-", "(reference check)"],
        ["naive float32 cumsum (context)", f"{rel_err(naive, ref):.2e}", "-", "-"],
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--lengths",
        default=None,
        help="comma list (default 1K,2K,4K,8K,16K,32K; --quick: 1K,2K), e.g. 1K,4K,16384",
    )
    ap.add_argument("--seq-max", type=int, default=4096, help="longest L timed for the sequential method")
    ap.add_argument("--err-length", type=int, default=4096, help="L of the float32-vs-float64 errors")
    ap.add_argument("--norm-length", type=int, default=65536, help="L of the TimestepNorm error")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3, help="timed iterations (best is reported)")
    ap.add_argument("--mem-cap-gb", type=float, default=16.0, help="abort a run whose RSS exceeds this")
    ap.add_argument(
        "--glibc-no-mmap",
        action="store_true",
        help=f"run the measurements with GLIBC_TUNABLES={GLIBC_NO_MMAP}",
    )
    ap.add_argument("--quick", action="store_true", help="small sizes, one timed iteration (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.repeat, args.err_length, args.norm_length = 1, 1024, 8192
    if args.lengths is None:
        args.lengths = "1K,2K" if args.quick else "1K,2K,4K,8K,16K,32K"
    lengths = parse_lengths(args.lengths)
    setup_threads()
    if args.glibc_no_mmap:
        use_glibc_no_mmap()

    print(f"# bench/cema.py  ({' '.join(sys.argv[1:]) or 'defaults'})")
    print(machine_description())
    res: dict[tuple[str, int], Measurement | None] = {}
    for length in lengths:
        for method in METHODS:
            if method == "sequential" and length > args.seq_max:
                res[method, length] = None
                continue
            m = run_isolated(
                bench_cema,
                args.mem_cap_gb,
                method=method,
                length=length,
                warmup=args.warmup,
                repeat=args.repeat,
            )
            res[method, length] = m
            shown = (
                f"best {fmt_time(m.best)}, peak +{fmt_bytes(m.delta_bytes, 'MiB')}, CPU util {m.cpu_utilisation:.2f}"
                if m.ok
                else m.status
            )
            print(f"  {method:10s} L={fmt_length(length):>4s}: {shown}", flush=True)
            if m.status == "error":
                print(m.message)

    def cell(method, length):
        m = res[method, length]
        if m is None:
            return "capped", "-", "-"
        if not m.ok:
            return m.status, "-", "-"
        base = res["fft", length]
        ratio = m.best / base.best if base is not None and base.ok else None
        return fmt_time(m.best), fmt_ratio(ratio), fmt_bytes(m.delta_bytes, "MiB")

    print(
        f"\nCEMA forward + backward, D {DIM}, N {NDIM}, B 1, fp32; best of {args.repeat} after {args.warmup} "
        f"warm-up; ratio = time / time(fft); mem = peak RSS minus RSS after construction (fresh process); "
        f'sequential capped at L <= {args.seq_max} ("capped").\n'
    )
    headers = ["L"] + [f"{m} {col}" for m in METHODS for col in ("time", "/fft", "mem")]
    rows = [[fmt_length(length)] + [c for m in METHODS for c in cell(m, length)] for length in lengths]
    print(markdown_table(headers, rows))

    print(
        f"\nfloat32 vs float64 (step-by-step recurrence) at L = {args.err_length}, target <= {TARGET_REL_ERR:g}:\n"
    )
    print(markdown_table(
        ["method", "rel err y", "rel err dx", "float64 method vs recurrence", "target"], cema_errors(args.err_length)
    ))  # fmt: skip

    print(
        f"\nTimestepNorm, x ~ N(100, 1), L = {args.norm_length}, D {DIM}, G {GROUPS}, target <= {TARGET_REL_ERR:g}:\n"
    )
    print(markdown_table(
        ["computation", "rel err y", "abs err final mean", "target"], timestep_norm_error(args.norm_length)
    ))  # fmt: skip


if __name__ == "__main__":
    main()
