"""Triton kernels on a GPU against the PyTorch references: median times, TFLOP/s, fraction of matmul rate.

    python -m bench.kernels                  # every section (every ``bench_*`` function of this file)
    python -m bench.kernels attention        # one section
    python -m bench.kernels attention --quick

Times are ``triton.testing.do_bench`` medians (ms) after warm-up (Triton autotuning included in warm-up).
"Fraction of matmul" divides a kernel's TFLOP/s by the rate this GPU measures for one large square matmul
in the same dtype, so the numbers read the same on any GPU. The memory-bound sections (``cema``,
``timestep_norm``) report instead the GB/s of their minimal traffic and its fraction of a measured device
copy bandwidth. Needs CUDA: without it the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/kernels.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.common import markdown_table, met

# ------------------------------------------------------------------------------------------------ shared


def matmul_tflops(dtype: torch.dtype, n: int = 8192) -> float:
    """Measured TFLOP/s of an n x n x n matmul: the yardstick for the "fraction of matmul" columns."""
    import triton.testing

    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = triton.testing.do_bench(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def median_ms(fn, grad_to_none=None) -> float | None:
    """do_bench median in ms; None when the call fails (out of memory, unsupported shape)."""
    import triton.testing

    try:
        return triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median")
    except (RuntimeError, torch.OutOfMemoryError) as e:
        print(f"    skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        torch.cuda.empty_cache()
        return None


def rate_cells(ms: float | None, flops: float, peak: float) -> list[str]:
    if ms is None:
        return ["-", "-", "-"]
    tflops = flops / (ms * 1e-3) / 1e12
    return [f"{ms:.3f}", f"{tflops:.1f}", f"{tflops / peak:.0%}"]


# ------------------------------------------------------------------------------------------------ attention


def attention_flops(batch: int, heads: int, length: int, chunk: int, dk: int, dv: int, causal: bool) -> float:
    """Forward matmul FLOPs of chunked attention (QKᵀ and PV, 2 per multiply-add), counting only the
    (query, key) pairs a causal chunk needs."""
    c = min(chunk, length)
    sizes = [c] * (length // c) + ([length % c] if length % c else [])
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in sizes)
    return 2.0 * batch * heads * pairs * (dk + dv)


# (B, h, L, C, dk, dv): equal head widths (SDPA comparable), Megalodon-like dk 128 / dv 256, and the paper's
# 7B-style widths (dk 256, dv 2048) where the value width is tiled across programs.
ATTENTION_SHAPES = [
    (4, 8, 8192, 2048, 128, 128),
    (8, 4, 4096, 1024, 64, 64),
    (4, 4, 8192, 2048, 128, 256),
    (1, 4, 8192, 2048, 256, 2048),
]
ATTENTION_SHAPES_QUICK = [(2, 4, 4096, 1024, 128, 128), (1, 2, 4096, 1024, 256, 2048)]


def _attention_rows(b, h, length, chunk, dk, dv, causal, dtype, peak, compiled_reference) -> list[list[str]]:
    """Timing rows of one shape: every implementation, forward and forward + backward."""
    from kernels.attention import reference
    from kernels.attention import triton as fused

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(b, length, h, dk, device="cuda", dtype=dtype, generator=g) / dk**0.25 for _ in "qk")
    v = torch.randn(b, length, h, dv, device="cuda", dtype=dtype, generator=g)
    do = torch.randn_like(v)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    nc = length // chunk
    fold = lambda t: (
        t.detach().reshape(b, nc, chunk, h, -1).permute(0, 1, 3, 2, 4).reshape(b * nc, h, chunk, -1)
    )
    folded = [fold(t).contiguous().requires_grad_() for t in (q, k, v)]
    impls = {
        "triton": (lambda: fused.chunk_attention(*leaves, chunk, causal), leaves, do),
        "reference": (lambda: reference.chunk_attention(*leaves, chunk, causal), leaves, do),
        "reference compiled": (lambda: compiled_reference(*leaves, chunk, causal), leaves, do),
    }
    if dk == dv:  # SDPA's fused backends want equal head widths
        sdpa = lambda: F.scaled_dot_product_attention(*folded, is_causal=causal, scale=1.0)
        impls["SDPA (pre-folded)"] = (sdpa, folded, fold(do).contiguous())
    fwd_flops = attention_flops(b, h, length, chunk, dk, dv, causal)
    shape = f"B{b} h{h} L{length} C{chunk} dk{dk} dv{dv} {'causal' if causal else 'bidir'}"
    rows = []
    for name, (fn, grads, cotangent) in impls.items():
        with torch.no_grad():
            fwd = median_ms(fn)
        both = median_ms(lambda fn=fn, ct=cotangent: fn().backward(ct), grad_to_none=grads)
        # backward = 5 matmuls of the forward's 2 -> fwd + bwd = 3.5x the forward FLOPs
        rows.append(
            [shape, name, *rate_cells(fwd, fwd_flops, peak), *rate_cells(both, 3.5 * fwd_flops, peak)]
        )
        print(" | ".join(rows[-1]), flush=True)
    return rows


def bench_attention(quick: bool = False, dtype: torch.dtype = torch.bfloat16) -> None:
    """kernels.attention: the fused Triton kernels vs the reference (eager, torch.compile) and vs SDPA on
    chunks folded into the batch beforehand (equal head widths only), forward and forward + backward."""
    from kernels.attention import reference

    peak = matmul_tflops(dtype)
    print(f"\n## chunk attention ({dtype}, matmul yardstick {peak:.0f} TFLOP/s)\n")
    compiled_reference = torch.compile(reference.chunk_attention, dynamic=False)
    rows = []
    for b, h, length, chunk, dk, dv in ATTENTION_SHAPES_QUICK if quick else ATTENTION_SHAPES:
        for causal in (True, False):
            rows += _attention_rows(b, h, length, chunk, dk, dv, causal, dtype, peak, compiled_reference)
            torch.cuda.empty_cache()
    headers = [
        "shape",
        "impl",
        "fwd ms",
        "fwd TFLOP/s",
        "fwd / matmul",
        "fwd+bwd ms",
        "fwd+bwd TFLOP/s",
        "/ matmul",
    ]
    print()
    print(markdown_table(headers, rows))


# ------------------------------------------------------------------------------------------------ memory-bound ops


def copy_gbps(n_bytes: int = 1 << 30) -> float:
    """Measured device copy bandwidth (GB/s, bytes read + written): the yardstick of the memory-bound ops."""
    import triton.testing

    src = torch.empty(n_bytes // 4, device="cuda", dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def _median_or_none(fn, grad_to_none=None) -> float | None:
    """Like ``median_ms``, but also survives torch.compile failures (reported, then skipped)."""
    try:
        return median_ms(fn, grad_to_none)
    except Exception as e:  # noqa: BLE001 - dynamo / inductor raise many types
        print(f"    skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        torch.cuda.empty_cache()
        return None


def _bandwidth_rows(
    shape: str, impls: dict, leaves: list, cotangent, io_elems: int, itemsize: int, copy: float
):
    """Rows: impl, fwd ms, fwd+bwd ms, fwd+bwd GB/s, fraction of copy, speed-up over the eager reference.

    Bytes are the minimum traffic of the op: forward reads x and writes y; backward reads x and dy and
    writes dx (5 passes over [B, L, D] in all; parameters and states are negligible)."""
    rows, times = [], {}
    for name, fn in impls.items():
        with torch.no_grad():
            fwd = _median_or_none(fn)
        both = _median_or_none(lambda fn=fn: torch.autograd.backward(fn()[0], cotangent), grad_to_none=leaves)
        times[name] = both
        gbps = None if both is None else 5 * io_elems * itemsize / (both * 1e-3) / 1e9
        rows.append([shape, name, "-" if fwd is None else f"{fwd:.3f}", "-" if both is None else f"{both:.3f}",
                     "-" if gbps is None else f"{gbps:.0f}", "-" if gbps is None else f"{gbps / copy:.0%}"])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    base = times.get("reference")
    for row, name in zip(rows, impls):
        t = times[name]
        row.append("-" if t is None or base is None else f"{base / t:.2f}x")
    return rows, times


BANDWIDTH_HEADERS = ["shape", "impl", "fwd ms", "fwd+bwd ms", "fwd+bwd GB/s", "/ copy", "vs reference"]
CEMA_SHAPES = [(1, 32768, 4096, 16), (4, 8192, 1024, 16), (8, 4096, 2048, 16)]
CEMA_SHAPES_QUICK = [(1, 8192, 1024, 16)]


def _cema_rows(b, length, d, n, dtype, copy, compiled_reference):
    from kernels.cema import reference
    from kernels.cema import triton as fused

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, length, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
    alpha, delta = 0.2 * torch.randn(2, d, n, 1, device="cuda", generator=g)
    theta = torch.randn(d, 1, 1, device="cuda", generator=g)
    gamma = torch.randn(d, n, 2, device="cuda", generator=g)
    p, q, gamma_c = (
        t.detach().requires_grad_() for t in reference.cema_coefficients(alpha, delta, theta, gamma)
    )
    omega = (0.25 * torch.randn(d, device="cuda", generator=g)).requires_grad_()
    leaves = [x, p, q, gamma_c, omega]
    impls = {
        "triton": lambda: fused.cema(*leaves),
        "reference": lambda: reference.cema(*leaves),
    }
    if compiled_reference is not None:
        impls["reference compiled"] = lambda: compiled_reference(*leaves)
    shape = f"B{b} L{length} D{d} N{n}"
    return _bandwidth_rows(shape, impls, leaves, torch.randn_like(x), b * length * d, x.element_size(), copy)


def bench_cema(quick: bool = False, dtype: torch.dtype = torch.bfloat16) -> None:
    """kernels.cema: the fused Triton chunked scan vs the reference (FFT convolution: eager and under
    torch.compile), forward + backward into x and every coefficient. Target: >= 3x the FFT reference at
    L = 32K, D = 4096, N = 16."""
    from kernels.cema import reference

    copy = copy_gbps()
    print(f"\n## CEMA ({dtype} x, float32 coefficients and state; copy bandwidth {copy:.0f} GB/s)\n")
    compiled_reference = torch.compile(reference.cema, dynamic=False)
    rows, target = [], None
    for b, length, d, n in CEMA_SHAPES_QUICK if quick else CEMA_SHAPES:
        new_rows, times = _cema_rows(b, length, d, n, dtype, copy, compiled_reference)
        rows += new_rows
        if (b, length, d, n) == CEMA_SHAPES[0] and times["triton"] and times["reference"]:
            target = times["reference"] / times["triton"]
        torch.cuda.empty_cache()
    print()
    print(markdown_table(BANDWIDTH_HEADERS, rows))
    if target is not None:
        print(
            f"\nTarget: fwd+bwd >= 3x the FFT reference at B1 L32768 D4096 N16: {target:.2f}x, {met(target >= 3)}"
        )


TIMESTEP_NORM_SHAPES = [(1, 32768, 4096, 64), (4, 8192, 2048, 32), (16, 2048, 1024, 32)]
TIMESTEP_NORM_SHAPES_QUICK = [(1, 8192, 1024, 16)]


def _timestep_norm_rows(b, length, d, groups, dtype, copy, compiled_reference):
    from kernels.timestep_norm import reference
    from kernels.timestep_norm import triton as fused

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (3 + torch.randn(b, length, d, device="cuda", generator=g)).to(dtype).requires_grad_()
    weight = (0.1 * torch.randn(d, device="cuda", generator=g)).requires_grad_()
    bias = (0.1 * torch.randn(d, device="cuda", generator=g)).requires_grad_()
    leaves = [x, weight, bias]
    impls = {
        "triton": lambda: fused.timestep_norm(*leaves, groups),
        "reference": lambda: reference.timestep_norm(*leaves, groups),
    }
    if compiled_reference is not None:
        impls["reference compiled"] = lambda: compiled_reference(*leaves, groups)
    shape = f"B{b} L{length} D{d} G{groups}"
    return _bandwidth_rows(shape, impls, leaves, torch.randn_like(x), b * length * d, x.element_size(), copy)


def bench_timestep_norm(quick: bool = False, dtype: torch.dtype = torch.bfloat16) -> None:
    """kernels.timestep_norm: the fused Triton kernels vs the reference (eager and under torch.compile),
    forward + backward into x, weight and bias. Target: fwd+bwd >= 60% of the copy bandwidth at L = 32K,
    D = 4096, bf16."""
    from kernels.timestep_norm import reference

    copy = copy_gbps()
    print(f"\n## TimestepNorm ({dtype}, float32 statistics; copy bandwidth {copy:.0f} GB/s)\n")
    compiled_reference = torch.compile(reference.timestep_norm, dynamic=False)
    rows, target = [], None
    for b, length, d, groups in TIMESTEP_NORM_SHAPES_QUICK if quick else TIMESTEP_NORM_SHAPES:
        new_rows, times = _timestep_norm_rows(b, length, d, groups, dtype, copy, compiled_reference)
        rows += new_rows
        if (b, length, d, groups) == TIMESTEP_NORM_SHAPES[0] and times["triton"]:
            target = 5 * b * length * d * dtype.itemsize / (times["triton"] * 1e-3) / 1e9 / copy
        torch.cuda.empty_cache()
    print()
    print(markdown_table(BANDWIDTH_HEADERS, rows))
    if target is not None:
        print(
            f"\nTarget: fwd+bwd >= 60% of copy bandwidth at B1 L32768 D4096 bf16: {target:.0%}, {met(target >= 0.6)}"
        )


# ------------------------------------------------------------------------------------------------ targets
# One shape each, no torch.compile: the checks of ``bench.gpu_check`` (value, passed, Markdown rows).

TARGET_TIMESTEP_NORM = 0.6  # fwd+bwd traffic / copy bandwidth at B1 L32768 D4096 G64 bf16
TARGET_CEMA = 3.0  # FFT reference time / Triton time, fwd+bwd at B1 L32768 D4096 N16 bf16
TARGET_ATTENTION = 1.2  # Triton fwd+bwd time / SDPA flash fwd+bwd time at the 7B head widths


def timestep_norm_target(dtype: torch.dtype = torch.bfloat16) -> tuple[float | None, bool, list[list[str]]]:
    """Fraction of the copy bandwidth reached by the fused TimestepNorm fwd+bwd at the 7B shape."""
    b, length, d, groups = TIMESTEP_NORM_SHAPES[0]
    copy = copy_gbps()
    rows, times = _timestep_norm_rows(b, length, d, groups, dtype, copy, None)
    value = (
        None
        if times["triton"] is None
        else 5 * b * length * d * dtype.itemsize / (times["triton"] * 1e-3) / 1e9 / copy
    )
    return value, value is not None and value >= TARGET_TIMESTEP_NORM, rows


def cema_target(dtype: torch.dtype = torch.bfloat16) -> tuple[float | None, bool, list[list[str]]]:
    """Speed-up of the fused CEMA over the FFT reference, fwd+bwd, at B1 L32768 D4096 N16."""
    rows, times = _cema_rows(*CEMA_SHAPES[0], dtype, copy_gbps(), None)
    t, ref = times["triton"], times["reference"]
    value = None if t is None or ref is None else ref / t
    return value, value is not None and value >= TARGET_CEMA, rows


ATTENTION_TARGET_SHAPES = [
    (1, 4, 4096, 4096, 256, 256),
    (1, 4, 4096, 4096, 256, 2048),
]  # (B, h, L, C, dk, dv)


def _sdpa_flash(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """SDPA's flash kernel on [B, h, C, d] chunks; a value width over the query width is split into tiles
    of the query width (the flash kernel needs equal widths), each call recomputing QKᵀ -- the same split
    the fused kernel makes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dk = q.shape[-1]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        tiles = [
            F.scaled_dot_product_attention(q, k, vt, is_causal=causal, scale=1.0) for vt in v.split(dk, -1)
        ]
    return torch.cat(tiles, -1)


def attention_target(dtype: torch.dtype = torch.bfloat16) -> tuple[float | None, bool, list[list[str]]]:
    """Worst ratio, over the 7B head widths (dk 256 with dv 256 and dv 2048), of the fused kernel's
    fwd+bwd time to SDPA flash's on the same causal chunks (C = L = 4096, so no folding is needed)."""
    from kernels.attention import triton as fused

    rows, worst = [], 0.0
    for b, h, length, chunk, dk, dv in ATTENTION_TARGET_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k = (
            torch.randn(b, length, h, dk, device="cuda", dtype=dtype, generator=g) / dk**0.25 for _ in "qk"
        )
        v = torch.randn(b, length, h, dv, device="cuda", dtype=dtype, generator=g)
        do = torch.randn_like(v)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        heads_first = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        do_hf = do.transpose(1, 2).contiguous()
        tri = lambda a=leaves, c=chunk, ct=do: fused.chunk_attention(*a, c, True).backward(ct)
        sdpa = lambda a=heads_first, ct=do_hf: _sdpa_flash(*a, True).backward(ct)
        t_tri, t_sdpa = median_ms(tri, grad_to_none=leaves), median_ms(sdpa, grad_to_none=heads_first)
        ratio = None if t_tri is None or t_sdpa is None else t_tri / t_sdpa
        worst = float("inf") if ratio is None else max(worst, ratio)
        shape = f"B{b} h{h} L{length} C{chunk} dk{dk} dv{dv} causal"
        rows.append([shape, "-" if t_tri is None else f"{t_tri:.3f}", "-" if t_sdpa is None else f"{t_sdpa:.3f}",
                     "-" if ratio is None else f"{ratio:.2f}"])  # fmt: skip
        torch.cuda.empty_cache()
    value = None if worst == float("inf") else worst
    return value, value is not None and value <= TARGET_ATTENTION, rows


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    sections = {
        name.removeprefix("bench_"): fn for name, fn in globals().items() if name.startswith("bench_")
    }
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("sections", nargs="*", help=f"any of {', '.join(sections)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller shapes")
    args = parser.parse_args(argv)
    unknown = [name for name in args.sections if name not in sections]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; expected any of {list(sections)}")
    if not torch.cuda.is_available():
        print("bench.kernels measures Triton kernels on a GPU: no CUDA device here, nothing to do.")
        return 0
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}")
    for name in args.sections or sections:
        sections[name](quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
