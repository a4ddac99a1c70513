"""``make gpu-bench``: the GPU path's speed against its roofline and the targets of issue 29, in <= 5 minutes.

    python -m bench.gpu_bench                     # every stage; writes bench/GPU_RESULTS.md stage by stage
    python -m bench.gpu_bench --roofline-only     # the analytic roofline (spec-sheet ceilings); any machine
    python -m bench.gpu_bench --stages ceilings,attention --out /tmp/r.md --deadline 120
    python -m bench.gpu_bench --autotune          # Triton's autotuners instead of fixed tiles (minutes more)

Runs on the GPU machine's own python3 (torch and Triton preinstalled, no project virtual environment): it
imports nothing outside torch, Triton and this repository's kernels and models (no omegaconf, no Lightning).

Stages, in order, each written to the report as it ends (a run cut off still leaves every finished stage),
each stopped at its budget and failing alone; the whole run stops starting stages at ``--deadline`` seconds
(default 285) after ``main`` started, so the command fits a 5-minute slot:

0. ``warm`` (65 s): six child processes (``--warm GROUP``) run the benchmark's Triton kernels once, so that
   Triton compiles them in parallel into its on-disk cache (it compiles serially in the launching process);
   nothing is timed. ``--no-warm`` skips it.
1. ``ceilings`` (20 s): device copy bandwidth (1 GiB, bytes read + written), dense bf16 GEMM rate and
   float32 SGEMM rate (TF32 off), n 8192, random data; every floor after this divides by these.
2. ``kernels`` (60 s): TimestepNorm (bf16 and float32), CEMA, Q/K norm + RoPE at B1 L32K and the 7B widths,
   forward and forward + backward; the decode GEMV at two 7B shapes, forward.
3. ``attention`` (60 s): every attention path side by side at the 7B's 4K chunk (dk 256, dv 256 and 2048,
   causal; ``bench.attention_gpu``'s comparison), SDPA flash beside them, and the path the dispatcher
   (``kernels.attention.attention_path``) picks, so its thresholds can be settled.
4. ``block_eager`` (45 s): one 7B-width block, Megalodon beside Llama-2, bf16-mixed, forward + backward, at
   4K and 32K.
5. ``block_variants`` (40 s): Megalodon's eager block under each attention variant (causal row blocks, P
   saved), in one process with the default first and last, to choose the defaults from the block.
6. ``block_compiled`` (60 s): the same through ``torch.compile`` (Inductor defaults, as
   ``trainer.compile=true`` compiles each block) at 4K.
7. ``block_reduce_overhead`` (50 s): ``torch.compile(mode="reduce-overhead")`` (CUDA graphs,
   ``trainer.compile_mode=reduce-overhead``) at 4K, where launch overhead matters.
8. ``block_compiled_long`` (60 s): ``torch.compile`` at 32K (no target: last, the first cut by the deadline).

Every timed figure has its analytic FLOPs and bytes (``bench.roofline``), the floor
max(FLOPs / rate, bytes / copy bandwidth) under the ceilings measured in stage 1, and measured / floor.
Times are medians of CUDA-event timings after a first call (compiles, autotuning) and one warm-up. Fixed
Triton tiles where a kernel autotunes (the fused attention kernel, the GEMV), as ``bench.gpu_check`` does,
unless ``--autotune``.

Exit codes: 0 when every stage ran (targets missed are reported, not failures), 1 when a stage failed or was
skipped for time, 2 at once without CUDA (before importing torch, when no NVIDIA driver is present).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/gpu_bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import roofline as rl
from bench.gpu_check import (
    Outcome,
    Report,
    StageResult,
    StageTimeout,
    has_nvidia_driver,
    markdown_table,
    run_stages,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "GPU_RESULTS.md"
DEFAULT_DEADLINE_S = 285.0
MIN_STAGE_S = 10.0  # a stage with less time than this left is skipped, not started
NO_CUDA = (
    "bench.gpu_bench needs a CUDA GPU (an NVIDIA driver and torch.cuda.is_available()); none found here. "
    "`python -m bench.gpu_bench --roofline-only` prints the analytic roofline on any machine."
)

# Targets of issue 29 (measured in one process, beside the Llama block).
TARGET_EAGER = {4096: 1.05, 32768: 0.70}  # Megalodon / Llama block time, eager
TARGET_COMPILED_4K = 1.2  # Megalodon / Llama, torch.compile, 4K
TARGET_ATTENTION_DV2048 = 0.5  # fwd+bwd minimal FLOPs / time / dense bf16 GEMM rate
TARGET_ATTENTION_DV256 = 1.1  # our best path / SDPA flash, fwd+bwd
TARGET_TIMESTEP_NORM = 0.6  # fwd+bwd minimal bytes / time / copy bandwidth
TARGET_CEMA_MS = 2.5  # fwd+bwd at B1 L32K D4096 N16

# ------------------------------------------------------------------------------------------------ state


@dataclass
class Sizes:
    """The shapes timed (the 7B widths); tests/bench shrink them to run every stage on the CPU."""

    kernel_length: int = 32768  # TimestepNorm, CEMA, Q/K norm + RoPE: B1 L32K
    dim: int = rl.MEGALODON_7B["dim"]
    groups: int = rl.MEGALODON_7B["groups"]
    ndim: int = rl.MEGALODON_7B["ndim"]
    heads: int = rl.MEGALODON_7B["heads"]
    z_dim: int = rl.MEGALODON_7B["z_dim"]
    ffn_dim: int = rl.MEGALODON_7B["ffn_dim"]
    chunk: int = rl.MEGALODON_7B["chunk"]
    attention: tuple[tuple[int, ...], ...] = ((1, 4, 4096, 4096, 256, 256), (1, 4, 4096, 4096, 256, 2048))
    block_lengths: tuple[int, ...] = rl.BLOCK_LENGTHS
    block_preset: str = "megalodon_7b"
    llama: dict | None = None  # bench.block.LLAMA_7B when None
    copy_bytes: int = 1 << 30
    gemm_n: int = 8192
    low_dtype: str = "bfloat16"  # the interpreter (CPU tests) has no bf16


@dataclass
class Bench:
    """What the stages share: the ceilings, the target and roofline rows the report leads with."""

    ceilings: rl.Ceilings | None = None
    targets: list[list[str]] = field(default_factory=list)  # [target, measured, verdict, stage]
    roofline: list[list[str]] = field(default_factory=list)  # [work, measured ms, floor ms, measured / floor]
    autotune: bool = False
    device: str = "cuda"
    sizes: Sizes = field(default_factory=Sizes)
    warm_only: bool = False  # in a ``--warm`` child: each timed function runs once, for its compiles

    def rates(self) -> rl.Ceilings:
        """The measured ceilings, or the spec sheet's when the ceilings stage did not run."""
        return self.ceilings or rl.H100_SXM_SPEC

    def target(self, what: str, value: str, ok: bool | None, stage: str) -> None:
        verdict = "-" if ok is None else ("met" if ok else "missed")
        self.targets.append([what, value, verdict, stage])

    def floor_cells(self, work: rl.Work, ms: float | None, label: str | None = None) -> list[str]:
        """[floor ms, measured / floor] for a measured time of ``work``; also kept (as ``label``, else the
        work's name) for the roofline table."""
        c = self.rates()
        floor_ms = work.floor_s(c) * 1e3
        ratio = None if ms is None else ms / floor_ms
        self.roofline.append([label or work.name, fmt(ms), fmt(floor_ms), work.bound(c), fmt(ratio, 2, "x")])
        return [fmt(floor_ms), fmt(ratio, 2, "x")]


STATE = Bench()


def fmt(value: float | None, digits: int | None = None, suffix: str = "") -> str:
    if value is None:
        return "-"
    if digits is None:
        digits = 3 if abs(value) < 10 else 1
    return f"{value:.{digits}f}{suffix}"


class BenchReport(Report):
    """gpu_check's report (rewritten in full after each stage) with the targets and the roofline first."""

    def __init__(self, path: Path, header: str, state: Bench):
        super().__init__(path, header)
        self.state = state

    def write(self, footer: str = "") -> None:
        s = self.state
        lead = "## Targets (issue 29)\n\n" + (
            markdown_table(["target", "measured", "verdict", "stage"], s.targets)
            if s.targets
            else "None measured yet."
        )
        c = s.rates()
        lead += (
            f"\n\n## Roofline\n\nCeilings: {c.source}: copy {c.copy_bytes_per_s / 1e12:.2f} TB/s, dense bf16 "
            f"{c.bf16_flops_per_s / 1e12:.0f} TFLOP/s, float32 {c.fp32_flops_per_s / 1e12:.1f} TFLOP/s. Floor = "
            "max(tensor FLOPs / bf16 rate + fp32 FLOPs / float32 rate, bytes / copy bandwidth), from bench/roofline.py.\n\n"
        )
        lead += (
            markdown_table(["work", "measured ms", "floor ms", "bound", "measured / floor"], s.roofline)
            if s.roofline
            else "No figure yet."
        )
        original = self.header
        self.header = f"{original}\n{lead}\n"
        try:
            super().write(footer)
        finally:
            self.header = original


# ------------------------------------------------------------------------------------------------ timing


def _sync() -> None:
    import torch

    if STATE.device == "cuda":
        torch.cuda.synchronize()


class _Timer:
    """CUDA events on the GPU; the host clock elsewhere (the CPU tests)."""

    def __init__(self):
        import torch

        self.cuda = STATE.device == "cuda"
        if self.cuda:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self.t = [0.0, 0.0]

    def mark(self, i: int) -> None:
        if self.cuda:
            self.events[i].record()
        else:
            self.t[i] = time.perf_counter()

    def ms(self) -> float:
        return self.events[0].elapsed_time(self.events[1]) if self.cuda else 1e3 * (self.t[1] - self.t[0])


def median_ms(fn: Callable[[], object], grad_to_none=(), rep_ms: float = 100.0, min_reps: int = 3,
              max_reps: int = 50) -> float:  # fmt: skip
    """Median time (ms, CUDA events) of ``fn`` after a first call (compiles, autotuning) and one warm-up; as
    many repetitions as fill ``rep_ms``, at least ``min_reps``. Gradients of ``grad_to_none`` are reset
    between calls, outside the timed region."""

    def reset():
        for t in grad_to_none:
            t.grad = None

    reset()
    fn()
    _sync()
    if STATE.warm_only:  # a warm-up child (stage ``warm``): the first call compiled what it needed
        return 1.0
    reset()
    warm = _Timer()
    warm.mark(0)
    fn()
    warm.mark(1)
    _sync()
    reps = int(min(max_reps, max(min_reps, rep_ms / max(warm.ms(), 1e-3))))
    timers = [_Timer() for _ in range(reps)]
    for timer in timers:
        reset()
        timer.mark(0)
        fn()
        timer.mark(1)
    _sync()
    return statistics.median(timer.ms() for timer in timers)


def _stage_timeout(e: BaseException | None) -> bool:
    """Whether ``e`` is, or wraps (Inductor re-raises what interrupts a compile), the stage's deadline."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, StageTimeout):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def try_ms(fn, grad_to_none=(), **kw) -> float | None:
    """``median_ms``, or None (printed) when the call fails: out of memory, an unsupported shape. The stage's
    deadline is not a failure of the call: it ends the stage."""
    try:
        return median_ms(fn, grad_to_none, **kw)
    except Exception as e:  # noqa: BLE001 -- reported as "-" in the table, the next row still runs
        if _stage_timeout(e):
            raise StageTimeout(str(e)) from e
        print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
        _empty_cache()
        return None


def _empty_cache() -> None:
    import torch

    if STATE.device == "cuda":
        torch.cuda.empty_cache()


def _randn(*shape, g=None, dtype=None):
    import torch

    return torch.randn(*shape, device=STATE.device, generator=g, dtype=dtype)


def _generator():
    import torch

    return torch.Generator(device=STATE.device).manual_seed(0)


def _low():
    """The low-precision dtype of the timed kernels (bf16; tests on the CPU interpreter use float16)."""
    import torch

    return getattr(torch, STATE.sizes.low_dtype)


# ------------------------------------------------------------------------------------------------ stages


def stage_ceilings() -> Outcome:
    """Copy bandwidth, dense bf16 GEMM and float32 SGEMM rates of this device, in this process."""
    import torch

    z = STATE.sizes
    src = _randn(z.copy_bytes // 4)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda s=src, d=dst: d.copy_(s))
    del src, dst
    n, rates = z.gemm_n, {}
    for dtype in (_low(), torch.float32):
        a, b = (_randn(n, n, dtype=dtype) for _ in "ab")
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # float32: the CUDA cores' rate, not TF32's
        try:
            rates[dtype] = 2 * n**3 / (median_ms(lambda a=a, b=b: a @ b) * 1e-3)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
        del a, b
    _empty_cache()
    STATE.ceilings = rl.Ceilings(
        2 * z.copy_bytes / (copy_ms * 1e-3), rates[_low()], rates[torch.float32], "measured in this process"
    )
    c, spec = STATE.ceilings, rl.H100_SXM_SPEC
    rows = [
        [f"copy ({z.copy_bytes / 2**30:g} GiB, read + write)", f"{c.copy_bytes_per_s / 1e12:.2f} TB/s", f"{spec.copy_bytes_per_s / 1e12:.2f} TB/s"],
        [f"dense {z.low_dtype} GEMM ({n}³)", f"{c.bf16_flops_per_s / 1e12:.0f} TFLOP/s", f"{spec.bf16_flops_per_s / 1e12:.0f} TFLOP/s"],
        [f"float32 SGEMM, TF32 off ({n}³)", f"{c.fp32_flops_per_s / 1e12:.1f} TFLOP/s", f"{spec.fp32_flops_per_s / 1e12:.1f} TFLOP/s"],
    ]  # fmt: skip
    return Outcome(True, markdown_table(["ceiling", "measured", "H100 SXM spec sheet"], rows))


KERNEL_HEADERS = ["kernel", "fwd ms", "fwd+bwd ms", "floor ms", "measured / floor", "achieved", "target"]


def kernel_works() -> dict[str, rl.Work]:
    """The kernels' analytic work at the timed sizes (bench.roofline.kernel_works at the 7B widths)."""
    z = STATE.sizes
    low = 2 if z.low_dtype in ("bfloat16", "float16") else 4
    return {
        "timestep_norm": rl.timestep_norm(1, z.kernel_length, z.dim, z.groups, itemsize=low),
        "timestep_norm_f32": rl.timestep_norm(1, z.kernel_length, z.dim, z.groups, itemsize=rl.F32),
        "cema": rl.cema(1, z.kernel_length, z.dim, z.ndim, itemsize=rl.F32),
        "qk_norm_rope": rl.qk_norm_rope(1, z.kernel_length, z.heads, z.z_dim // z.heads, itemsize=low),
        "gemv_ffn_in": rl.gemv(2 * z.ffn_dim, z.dim, itemsize=low),
        "gemv_ffn_out": rl.gemv(z.dim, z.ffn_dim, itemsize=low),
    }


def _bandwidth(work: rl.Work, ms: float | None) -> str:
    return "-" if ms is None else f"{work.bytes / (ms * 1e-3) / 1e9:.0f} GB/s"


def _timestep_norm_row(dtype_name: str, work: rl.Work) -> tuple[list[str], float | None]:
    import torch

    from kernels.timestep_norm import timestep_norm

    z, g = STATE.sizes, _generator()
    x = (3 + _randn(1, z.kernel_length, z.dim, g=g)).to(getattr(torch, dtype_name)).requires_grad_()
    w, bias = ((0.1 * _randn(z.dim, g=g)).requires_grad_() for _ in "wb")
    ct = torch.randn_like(x)
    leaves = (x, w, bias)
    with torch.no_grad():
        fwd = try_ms(lambda: timestep_norm(x, w, bias, z.groups))
    both = try_ms(lambda: timestep_norm(x, w, bias, z.groups)[0].backward(ct), leaves)
    frac = None if both is None else work.bytes / (both * 1e-3) / STATE.rates().copy_bytes_per_s
    return [work.name, fmt(fwd), fmt(both), *STATE.floor_cells(work, both),
            _bandwidth(work, both) + ("" if frac is None else f" ({frac:.0%} of copy)")], frac  # fmt: skip


def _cema_row(work: rl.Work, method: str = "auto") -> tuple[list[str], float | None]:
    import torch

    from kernels.cema import cema_from_parameters

    z, g = STATE.sizes, _generator()
    d, n = z.dim, z.ndim
    x = _randn(1, z.kernel_length, d, g=g)  # float32: the model's island
    alpha, delta = (0.2 * _randn(d, n, 1, g=g) for _ in "ad")
    theta, gamma, omega = _randn(d, 1, 1, g=g), _randn(d, n, 2, g=g), 0.25 * _randn(d, g=g)
    leaves = tuple(t.requires_grad_() for t in (x, alpha, delta, theta, gamma, omega))
    ct = torch.randn_like(x)
    if method != "auto":  # its own line in the roofline table
        work = rl.Work(
            f"{work.name}, {method}", flops=work.flops, simt_flops=work.simt_flops, bytes=work.bytes
        )
    with torch.no_grad():
        fwd = try_ms(lambda: cema_from_parameters(*leaves, method=method))
    both = try_ms(lambda: cema_from_parameters(*leaves, method=method).backward(ct), leaves)
    c = STATE.rates()
    unit = None if both is None else work.simt_flops / (both * 1e-3) / c.fp32_flops_per_s
    achieved = "-" if both is None else f"{unit:.0%} of float32 rate, " + _bandwidth(work, both)
    return [work.name, fmt(fwd), fmt(both), *STATE.floor_cells(work, both), achieved], both


def _qk_row(work: rl.Work) -> list[str]:
    import torch

    from kernels.qk_norm_rope import qk_norm_rope

    z, g = STATE.sizes, _generator()
    h, zd = z.heads, z.z_dim // z.heads
    q_in = _randn(1, z.kernel_length, h, zd, g=g).to(_low()).requires_grad_()
    gamma, beta = ((0.1 * _randn(2, h * zd, g=g)).requires_grad_() for _ in "gb")
    cts = [torch.randn_like(q_in) for _ in "qk"]

    def run():
        return qk_norm_rope(q_in, gamma, beta, 1e5, 1e-5, z.chunk, 0, _low())

    with torch.no_grad():
        fwd = try_ms(run)
    both = try_ms(lambda: torch.autograd.backward(run(), cts), (q_in, gamma, beta))
    return [work.name, fmt(fwd), fmt(both), *STATE.floor_cells(work, both), _bandwidth(work, both)]


def _gemv_row(work: rl.Work, rows: int, cols: int) -> list[str]:
    from kernels.gemv import row_gemv

    g = _generator()
    w, x, bias = _randn(rows, cols, g=g).to(_low()), _randn(cols, g=g), _randn(rows, g=g)
    with fixed_gemv_tiles():
        fwd = try_ms(lambda: row_gemv(w, x, bias))
    return [work.name, fmt(fwd), "-", *STATE.floor_cells(work, fwd), _bandwidth(work, fwd)]


@contextlib.contextmanager
def fixed_gemv_tiles():
    """The GEMV's default tiles (one of its autotune configurations) unless ``--autotune``."""
    if STATE.autotune:
        yield
        return
    from kernels.gemv import triton as gemv_triton

    with gemv_triton.fixed_config():
        yield


def stage_kernels() -> Outcome:
    """The Megalodon kernels at the 7B widths against their floors."""
    works, z = kernel_works(), STATE.sizes
    rows = []
    tsn_row, tsn_frac = _timestep_norm_row(z.low_dtype, works["timestep_norm"])
    rule = lambda v: v >= TARGET_TIMESTEP_NORM  # noqa: E731
    rows.append(tsn_row + [f">= {TARGET_TIMESTEP_NORM:.0%} of copy: {_verdict(tsn_frac, rule)}"])
    STATE.target(f"TimestepNorm fwd+bwd >= {TARGET_TIMESTEP_NORM:.0%} of copy bandwidth ({works['timestep_norm'].name} {z.low_dtype})",
                 fmt(None if tsn_frac is None else 100 * tsn_frac, 0, "%"), _ok(tsn_frac, rule), "kernels")  # fmt: skip
    _empty_cache()
    row, _ = _timestep_norm_row("float32", works["timestep_norm_f32"])
    rows.append(row + ["- (the block's dtype)"])
    _empty_cache()
    cema_row, cema_ms = _cema_row(works["cema"])
    rule = lambda v: v <= TARGET_CEMA_MS  # noqa: E731
    rows.append(cema_row + [f"<= {TARGET_CEMA_MS} ms: {_verdict(cema_ms, rule)}"])
    STATE.target(f"CEMA fwd+bwd <= {TARGET_CEMA_MS} ms ({works['cema'].name})", fmt(cema_ms, 2, " ms"),
                 _ok(cema_ms, rule), "kernels")  # fmt: skip
    _empty_cache()
    # The tensor-core form (MEGA_SUITE_CEMA=tc), timed beside the default so the default can be chosen by it.
    tc_row, tc_ms = _cema_row(works["cema"], method="tensor_cores")
    speed = "-" if tc_ms is None or cema_ms is None else f"{cema_ms / tc_ms:.2f}x the default's speed"
    rows.append(tc_row + [f"{speed}; <= {TARGET_CEMA_MS} ms: {_verdict(tc_ms, rule)}"])
    STATE.target(f"CEMA fwd+bwd <= {TARGET_CEMA_MS} ms, tensor-core form", fmt(tc_ms, 2, " ms"),
                 _ok(tc_ms, rule), "kernels")  # fmt: skip
    _empty_cache()
    rows.append(_qk_row(works["qk_norm_rope"]) + ["-"])
    _empty_cache()
    rows.append(_gemv_row(works["gemv_ffn_in"], 2 * z.ffn_dim, z.dim) + ["-"])
    rows.append(_gemv_row(works["gemv_ffn_out"], z.dim, z.ffn_dim) + ["-"])
    _empty_cache()
    body = (
        "Each kernel through its dispatcher (the Triton path on CUDA), forward and forward + backward into every "
        "input; TimestepNorm also in float32 (the block runs it and CEMA as float32 islands); CEMA from its raw "
        "parameters as the model trains it; the GEMV forward only (decoding). Floors and FLOP / byte counts: "
        "bench/roofline.py.\n\n"
    )
    return Outcome(True, body + markdown_table(KERNEL_HEADERS, rows))


def _ok(value, rule) -> bool | None:
    return None if value is None else bool(rule(value))


def _verdict(value, rule) -> str:
    ok = _ok(value, rule)
    return "not measured" if ok is None else ("met" if ok else "missed")


# attention --------------------------------------------------------------------------------------------------


def _sdpa_flash(q, k, v, chunk: int):
    """SDPA's flash kernel per chunk; a value width over dk cut into dk-wide tiles (flash wants dk == dv),
    each tile recomputing QKᵀ, as the fused Triton kernel does per value tile."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.attention import sdpa

    dk = q.shape[-1]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        if v.shape[-1] == dk:
            return sdpa.chunk_attention(q, k, v, chunk, True)
        return torch.cat([sdpa.chunk_attention(q, k, vt, chunk, True) for vt in v.split(dk, -1)], -1)


def _attention_paths(dk: int, dv: int, c: int) -> dict[str, Callable]:
    from kernels.attention import probs, sdpa
    from kernels.attention import triton as fused

    rb = probs.default_row_block(c, True)
    paths = {
        "probs": lambda q, k, v, C: probs.chunk_attention(q, k, v, C, True, save_probs=False),
        "probs, saved P": lambda q, k, v, C: probs.chunk_attention(q, k, v, C, True, save_probs=True),
        "fused": lambda q, k, v, C: fused.chunk_attention(q, k, v, C, True),
        "SDPA flash": _sdpa_flash,
    }
    if dk == dv:
        paths["sdpa"] = lambda q, k, v, C: sdpa.chunk_attention(q, k, v, C, True)
    else:  # the causal row blocks (default c / CAUSAL_ROW_BLOCKS) against halves and one square
        for other in sorted({c // 2, c} - {rb}):
            name = "probs, one square" if other == c else f"probs, row_block {other}"
            paths[name] = lambda q, k, v, C, rb=other: probs.chunk_attention(q, k, v, C, True, row_block=rb)
    return paths


@contextlib.contextmanager
def fixed_attention_tiles():
    """Fixed tiles for the fused kernel (gpu_check's) unless ``--autotune``: its autotuner compiles and times
    about 20 configurations per (dk, dv), minutes of a short slot."""
    if STATE.autotune:
        yield
        return
    from kernels.attention import triton as fused

    with fused.kernel_config(
        fused.KernelConfig(block_m=64, block_n=64, block_dv=64, num_warps=4, num_stages=2)
    ):
        yield


ATTENTION_HEADERS = ["shape", "path", "fwd ms", "fwd+bwd ms", "TFLOP/s (minimal)", "/ GEMM", "floor ms",
                     "measured / floor", "note"]  # fmt: skip


def _attention_shape(
    b: int, h: int, length: int, chunk: int, dk: int, dv: int
) -> tuple[list[list[str]], list[str]]:
    """Rows of every path at one shape, and the lines naming the dispatcher's choice and the fastest path;
    records the shape's targets."""
    import torch

    from kernels.attention import attention_path

    c = STATE.rates()
    work = rl.attention(b, h, length, chunk, dk, dv)
    g = _generator()
    q, k = (_randn(b, length, h, dk, g=g, dtype=_low()) / dk**0.25 for _ in "qk")
    v = _randn(b, length, h, dv, g=g, dtype=_low())
    do = torch.randn_like(v)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    chosen = attention_path(q, k, v, on_gpu=True)
    times, rows, lines = {}, [], []
    for name, fn in _attention_paths(dk, dv, min(chunk, length)).items():
        with torch.no_grad(), fixed_attention_tiles():
            fwd = try_ms(lambda fn=fn: fn(*leaves, chunk))
        with fixed_attention_tiles():
            both = try_ms(lambda fn=fn: fn(*leaves, chunk).backward(do), leaves)
        times[name] = both
        rate = None if both is None else work.flops / (both * 1e-3)
        rows.append([f"dk{dk} dv{dv}", name, fmt(fwd), fmt(both), fmt(None if rate is None else rate / 1e12, 0),
                     fmt(None if rate is None else 100 * rate / c.bf16_flops_per_s, 0, "%"),
                     *STATE.floor_cells(rl.Work(f"{work.name}: {name}", flops=work.flops, bytes=work.bytes), both),
                     "dispatcher's choice" if name == chosen else ""])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
        _empty_cache()
    ours = {n: t for n, t in times.items() if t is not None and n not in ("SDPA flash", "sdpa")}
    timed = [n for n in times if times[n] is not None]
    if ours:
        best, fastest = min(ours, key=ours.get), min(timed, key=times.get)
        lines.append(f"- dk {dk}, dv {dv}: the dispatcher picks `{chosen}`; fastest measured `{fastest}` "
                     f"({times[fastest]:.3f} ms); fastest of ours `{best}` ({ours[best]:.3f} ms).")  # fmt: skip
    if dv > dk:
        t = times.get(chosen)
        frac = None if t is None else work.flops / (t * 1e-3) / c.bf16_flops_per_s
        STATE.target(f"attention dv {dv} fwd+bwd >= {TARGET_ATTENTION_DV2048:.0%} of the bf16 GEMM rate "
                     f"(minimal FLOPs; the dispatcher's `{chosen}`)", fmt(None if frac is None else 100 * frac, 0, "%"),
                     _ok(frac, lambda v: v >= TARGET_ATTENTION_DV2048), "attention")  # fmt: skip
    else:  # the dispatcher's path (SDPA where it applies), and our kernels (DropKey / padding / dk != dv)
        flash = times.get("SDPA flash")
        t = times.get(chosen)
        ratio = None if t is None or not flash else t / flash
        STATE.target(f"attention dv {dv} fwd+bwd <= {TARGET_ATTENTION_DV256}x SDPA flash (the dispatcher's `{chosen}`)",
                     fmt(ratio, 2, "x"), _ok(ratio, lambda v: v <= TARGET_ATTENTION_DV256), "attention")  # fmt: skip
        ratio = None if not ours or not flash else min(ours.values()) / flash
        STATE.target(f"attention dv {dv} fwd+bwd <= {TARGET_ATTENTION_DV256}x SDPA flash (best of probs / fused)",
                     fmt(ratio, 2, "x"), _ok(ratio, lambda v: v <= TARGET_ATTENTION_DV256), "attention")  # fmt: skip
    return rows, lines


def stage_attention() -> Outcome:
    """Every attention path at the 7B's 4K chunk, fwd and fwd+bwd, against the minimal FLOPs' floor."""
    rows, lines = [], []
    for shape in STATE.sizes.attention:
        more_rows, more_lines = _attention_shape(*shape)
        rows += more_rows
        lines += more_lines
        _empty_cache()
    body = (
        "B1 h4 L4096 C4096, causal. Paths: `probs` (materialised probabilities, P recomputed in backward), "
        "`probs, saved P`, `fused` (the flash-style Triton kernel"
        + ("" if STATE.autotune else ", fixed tiles 64 x 64 x 64, 4 warps, 2 stages")
        + "), `sdpa` (the dispatcher's SDPA per chunk, default backends), `SDPA flash` (flash forced; V in dk-wide "
        "tiles where dv > dk). TFLOP/s counts the minimal FLOPs (bench/roofline.py `attention`).\n\n"
    )
    return Outcome(True, body + markdown_table(ATTENTION_HEADERS, rows) + "\n\n" + "\n".join(lines))


# block ------------------------------------------------------------------------------------------------------

# "eager" and torch.compile's modes (mega_suite.config's COMPILE_MODES; the ones capturing CUDA graphs mark a step)
BLOCK_MODES = ("eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def _llama_dims() -> dict:
    from bench import block as bb

    return STATE.sizes.llama or bb.LLAMA_7B


def block_works(length: int) -> dict[str, rl.Work]:
    """The blocks' analytic work at ``length`` for the built widths (the preset's and Llama's)."""
    from mega_suite import get_config

    cfg = get_config(STATE.sizes.block_preset, chunk_size=STATE.sizes.chunk)
    mega = rl.megalodon_block(
        length, dim=cfg.model_dim, z_dim=cfg.z_dim, value_dim=cfg.value_dim, ffn_dim=cfg.ffn_hidden_dim,
        heads=cfg.num_heads, ndim=cfg.cema_ndim, groups=cfg.norm_num_groups, chunk=cfg.chunk_size,
    )  # fmt: skip
    return {"megalodon": mega, "llama": rl.llama_block(length, **_llama_dims())}


def block_step(kind: str, length: int, mode: str = "eager") -> tuple[Callable[[], None], list]:
    """One 7B-width block's forward + backward at batch 1, bf16-mixed (bench/block.py's builders), and the
    tensors whose gradients the step sets. ``mode``: "eager", or a torch.compile mode ("default" as
    ``trainer.compile=true``, "reduce-overhead": CUDA graphs, a new step marked per call), static shapes."""
    import torch

    from bench import block as bb

    if mode not in BLOCK_MODES:
        raise ValueError(f"block mode must be one of {BLOCK_MODES}, got {mode!r}")
    if kind not in ("megalodon", "llama"):
        raise ValueError(f"block kind must be 'megalodon' or 'llama', got {kind!r}")
    z = STATE.sizes
    torch.manual_seed(0)
    with torch.device(STATE.device):  # initialised on the device: a 7B-width block on the host takes seconds
        block = bb.build_block(kind, z.chunk, 32, preset=z.block_preset, llama=_llama_dims())
    run = block
    if mode != "eager":
        run = torch.compile(block, dynamic=False, mode=None if mode == "default" else mode)
    width = block.cfg.model_dim if kind == "megalodon" else _llama_dims()["dim"]
    x = _randn(1, length, width).requires_grad_()
    ct = _randn(1, length, width)
    if kind == "llama":  # its RoPE table made before capture: a table made inside a CUDA graph is overwritten
        block._cos_sin(length, x.device)

    def step():
        if mode in CUDAGRAPH_MODES:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(STATE.device, getattr(torch, z.low_dtype)):
            out = run(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(ct)

    return step, [x, *block.parameters()]


def _block_table(mode: str, lengths: tuple[int, ...]) -> tuple[list[list[str]], dict[int, float | None]]:
    import torch

    rows, ratios = [], {}
    for length in lengths:
        t, works = {}, block_works(length)
        for kind in ("megalodon", "llama"):
            first = time.perf_counter()
            step, grads = block_step(kind, length, mode)
            t[kind] = try_ms(step, grads, rep_ms=300)
            seconds = time.perf_counter() - first
            work = works[kind]
            rows.append([f"{length // 1024}K" if length >= 1024 else str(length), kind, mode, fmt(t[kind]),
                         *STATE.floor_cells(rl.Work(f"{work.name} {mode}", flops=work.flops,
                                                    simt_flops=work.simt_flops, bytes=work.bytes), t[kind]),
                         fmt(work.parts_floor_s(STATE.rates()) * 1e3), f"{seconds:.0f}"])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
            del step, grads
            if mode != "eager":
                torch._dynamo.reset()
            _empty_cache()
        ratios[length] = None if None in t.values() else t["megalodon"] / t["llama"]
    return rows, ratios


BLOCK_HEADERS = [
    "L",
    "block",
    "mode",
    "ms",
    "floor ms",
    "measured / floor",
    "Σ parts floor ms",
    "s (incl. compile)",
]
BLOCK_NOTE = (
    "One block at the 7B widths (Megalodon `megalodon_7b`: D 4096, Z 1024, E 8192, F 8192 SwiGLU, h 4, C 4096; "
    "Llama-2-7B: D 4096, 32 heads, FFN 11008, SDPA causal over the whole length), batch 1, bf16-mixed, forward + "
    "backward into the input and every parameter. Floors from bench/roofline.py (minimal FLOPs; Σ parts: each "
    "part's own floor summed). Paper (whole 7B models, A100): Megalodon / Llama 1.06 at 4K, 0.76 at 32K.\n\n"
)


def _ratio_lines(mode: str, ratios: dict[int, float | None]) -> str:
    c, lines = STATE.rates(), []
    for length, r in ratios.items():
        works = block_works(length)
        floor = works["megalodon"].floor_s(c) / works["llama"].floor_s(c)
        lines.append(f"- L {length}, {mode}: Megalodon / Llama {fmt(r, 2)} (their floors' ratio {floor:.2f})")
    return "\n".join(lines)


def _block_outcome(mode: str, rows, ratios) -> Outcome:
    return Outcome(
        True, BLOCK_NOTE + markdown_table(BLOCK_HEADERS, rows) + "\n\n" + _ratio_lines(mode, ratios)
    )


def stage_block_eager() -> Outcome:
    rows, ratios = _block_table("eager", STATE.sizes.block_lengths)
    for length, r in ratios.items():
        limit = TARGET_EAGER.get(length)
        what = f"Megalodon / Llama eager at L {length}" + ("" if limit is None else f" <= {limit}")
        STATE.target(
            what, fmt(r, 2), None if limit is None else _ok(r, lambda v, t=limit: v <= t), "block_eager"
        )
    return _block_outcome("eager", rows, ratios)


def _compiled(lengths: tuple[int, ...], stage: str) -> Outcome:
    rows, ratios = _block_table("default", lengths)
    for length, r in ratios.items():
        limit = TARGET_COMPILED_4K if length == 4096 else None
        what = f"Megalodon / Llama compiled at L {length}" + ("" if limit is None else f" <= {limit}")
        STATE.target(what, fmt(r, 2), None if limit is None else _ok(r, lambda v, t=limit: v <= t), stage)
    return _block_outcome("compiled", rows, ratios)


def stage_block_compiled() -> Outcome:
    """torch.compile'd blocks at the shortest length (the target's 4K)."""
    return _compiled((min(STATE.sizes.block_lengths),), "block_compiled")


def stage_block_compiled_long() -> Outcome:
    """torch.compile'd blocks at the other lengths (32K); last, as it has no target."""
    lengths = tuple(sorted(STATE.sizes.block_lengths))[1:]
    return _compiled(lengths, "block_compiled_long")


# The attention choices that timing the kernel alone could not settle (on an H200 one square was faster
# alone, the block slower with it), each as settings of kernels.attention.probs, timed inside the block.
BLOCK_VARIANTS: tuple[tuple[str, dict], ...] = (
    ("default", {}),
    ("one square", {"CAUSAL_ROW_BLOCKS": 1}),
    ("halves", {"CAUSAL_ROW_BLOCKS": 2}),
    ("saved P", {"SAVE_PROBS": True}),
    ("default again", {}),
)


@contextlib.contextmanager
def _module_settings(module, settings: dict):
    old = {name: getattr(module, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


def stage_block_variants() -> Outcome:
    """Megalodon's eager block at each length under each attention variant, in one process, with the default
    timed first and last: its drift says how large a difference must be to mean something."""
    from kernels.attention import probs

    rows = []
    for length in STATE.sizes.block_lengths:
        step, grads = block_step("megalodon", length, "eager")
        base = None
        for name, settings in BLOCK_VARIANTS:
            with _module_settings(probs, settings):
                ms = try_ms(step, grads, rep_ms=300)
            base = ms if base is None else base
            rows.append([f"{length // 1024}K" if length >= 1024 else str(length), name, fmt(ms),
                         fmt(None if ms is None or base is None else ms / base, 3)])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
        del step, grads
        _empty_cache()
    body = (
        "Megalodon's block as in block_eager, under each attention variant (`kernels.attention.probs` settings: "
        "causal row blocks, P saved for backward); the default first and last.\n\n"
    )
    return Outcome(True, body + markdown_table(["L", "attention", "ms", "/ default"], rows))


def stage_block_reduce_overhead() -> Outcome:
    length = min(STATE.sizes.block_lengths)
    rows, ratios = _block_table("reduce-overhead", (length,))
    STATE.target(f"Megalodon / Llama reduce-overhead at L {length} (no target)", fmt(ratios.get(length), 2), None,
                 "block_reduce_overhead")  # fmt: skip
    return _block_outcome("reduce-overhead", rows, ratios)


# warm-up ------------------------------------------------------------------------------------------------


def _warm_megalodon() -> None:
    for length in STATE.sizes.block_lengths:
        median_ms(*block_step("megalodon", length))


def _warm_kernels(*names: str) -> None:
    works, z = kernel_works(), STATE.sizes
    for name in names:
        if name == "timestep_norm":
            _timestep_norm_row(z.low_dtype, works["timestep_norm"])
            _timestep_norm_row("float32", works["timestep_norm_f32"])
        elif name == "cema":
            _cema_row(works["cema"])
        elif name == "qk_norm_rope":
            _qk_row(works["qk_norm_rope"])
        elif name == "gemv":
            _gemv_row(works["gemv_ffn_in"], 2 * z.ffn_dim, z.dim)


WARM_GROUPS: dict[str, Callable[[], object]] = {
    "cema": lambda: _warm_kernels("cema"),
    "timestep_norm": lambda: _warm_kernels("timestep_norm"),
    "qk_norm_rope_gemv": lambda: _warm_kernels("qk_norm_rope", "gemv"),
    "attention_dv256": lambda: _attention_shape(*STATE.sizes.attention[0]),
    "attention_dv2048": lambda: _attention_shape(*STATE.sizes.attention[-1]),
    "megalodon_block": _warm_megalodon,
}  # fmt: skip
WARM_TIMEOUT_S = 60


def warm_child(group: str) -> int:
    """``--warm GROUP``: run the group's kernels once (each first call compiles into Triton's on-disk cache)."""
    STATE.warm_only = True
    with fixed_attention_tiles():
        WARM_GROUPS[group]()
    return 0


def stage_warm() -> Outcome:
    """Triton compiles the benchmark's kernels in parallel child processes, one per group, into its on-disk
    cache, before anything is timed: Triton compiles serially in the process that launches (what that costs:
    bench/reports/2026-11-27-gpu-bench-roofline.md); the timed stages then find every kernel cached. Failing
    children cost only their time: the stages compile whatever is missing themselves."""
    import shutil

    procs, logs = {}, {}
    start = time.perf_counter()
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_bench_warm"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for group in WARM_GROUPS:
        logs[group] = (log_dir / f"{group}.log").open("w")
        cmd = [sys.executable, "-m", "bench.gpu_bench", "--warm", group] + (
            ["--autotune"] if STATE.autotune else []
        )
        procs[group] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logs[group], stderr=subprocess.STDOUT)
    rows, ok = [], True
    try:
        for group, proc in procs.items():
            try:
                rc = proc.wait(timeout=max(1.0, WARM_TIMEOUT_S - (time.perf_counter() - start)))
            except subprocess.TimeoutExpired:
                rc = None
            rows.append([group, "timeout" if rc is None else rc, f"{time.perf_counter() - start:.0f}"])
            ok &= rc == 0
    finally:  # also on the stage's own timeout: no child is left compiling beside the timed stages
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in logs.values():
            f.close()
    tails = ""
    for group, rc, _ in rows:
        if rc != 0:
            tails += f"\n`{group}`:\n\n```\n{(log_dir / f'{group}.log').read_text()[-1500:]}\n```\n"
    body = (
        f"{len(procs)} child processes, one per group, each running its kernels once (`--warm GROUP`); "
        "seconds since the stage began when each was found finished.\n\n"
        + markdown_table(["group", "exit", "s"], rows)
        + tails
    )
    return Outcome(ok, body)


STAGES: list[tuple[str, float, Callable[[], Outcome]]] = [
    ("warm", WARM_TIMEOUT_S + 5, stage_warm),
    ("ceilings", 20, stage_ceilings),
    ("kernels", 60, stage_kernels),
    ("attention", 60, stage_attention),
    ("block_eager", 45, stage_block_eager),
    ("block_variants", 40, stage_block_variants),
    ("block_compiled", 60, stage_block_compiled),
    ("block_reduce_overhead", 50, stage_block_reduce_overhead),
    ("block_compiled_long", 60, stage_block_compiled_long),
]  # budgets (s), enforced (+ gpu_check's grace); the deadline cuts what does not fit: the last stages go first


# ------------------------------------------------------------------------------------------------ main


def run_within(stages, report: Report, deadline_s: float, clock: Callable[[], float] = time.monotonic,
               start: float | None = None) -> list[StageResult]:  # fmt: skip
    """Run the stages in order, each for at most its budget or the time left before ``deadline_s`` (counted
    from ``start``, a reading of ``clock``: by default this call); a stage with less than ``MIN_STAGE_S`` left
    is recorded as skipped, not started."""
    from bench import gpu_check

    start = clock() if start is None else start  # never the import's time: a test worker may be hours old
    results: list[StageResult] = []
    for name, budget, fn in stages:
        left = deadline_s - (clock() - start) - gpu_check.STAGE_GRACE_S
        if left < MIN_STAGE_S:
            result = StageResult(
                name, False, 0.0, budget, f"Not run: the run's deadline ({deadline_s:.0f} s) came first.", {}
            )
            report.add(result)
            results.append(result)
            print(f"=== {name}: skipped, deadline", flush=True)
            continue
        run_stages([(name, min(budget, left), fn)], report, results, summary=False)
    gpu_check.write_summary(report, results)
    return results


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        return text.split("Kernel Module")[1].split()[0]
    except (OSError, IndexError):
        return "?"


def triton_build() -> str:
    """The first 12 hex digits of sha256(libtriton), which Triton's cache key hashes: two machines' caches
    can share entries only where this (and the Triton version) agree (docs/kernels.md#gpu-benchmark)."""
    try:
        import triton

        lib = Path(triton.__file__).parent / "_C" / "libtriton.so"
        digest = hashlib.sha256()
        with lib.open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        return digest.hexdigest()[:12]
    except OSError:
        return "?"


def _commit() -> str:
    commit = os.environ.get("MEGA_COMMIT", "")  # a copy of the tree without .git (a lent machine) names it
    if commit:
        return commit
    try:
        git = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        return git.stdout.strip() or "?"
    except OSError:
        return "?"


def header() -> str:
    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    return (
        "# GPU benchmark (`make gpu-bench`, bench/gpu_bench.py)\n\n"
        f"Device: **{torch.cuda.get_device_name(0)}** ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}, "
        f"{props.multi_processor_count} SMs), driver {_driver_version()}; torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"Triton {triton.__version__} (libtriton {triton_build()}), Python {platform.python_version()}; commit {_commit()}; "
        f"{datetime.datetime.now(datetime.UTC).isoformat(timespec='minutes')}; "
        f"Triton tiles {'autotuned' if STATE.autotune else 'fixed where a kernel autotunes'}.\n"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="the Markdown report (default: %(default)s)"
    )
    ap.add_argument("--stages", default=None, help=f"comma list, any of {', '.join(n for n, _, _ in STAGES)}")
    ap.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                    help="seconds after start past which no stage starts or runs on (default %(default)s)")  # fmt: skip
    ap.add_argument("--autotune", action="store_true", help="Triton autotuners instead of fixed tiles")
    ap.add_argument("--no-warm", action="store_true", help="skip the parallel compile stage (warm)")
    ap.add_argument("--warm", choices=sorted(WARM_GROUPS), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--roofline-only", action="store_true",
                    help="print the analytic roofline table (H100 spec-sheet ceilings) and exit; no GPU needed")  # fmt: skip
    args = ap.parse_args(argv)
    if args.deadline <= 0:
        ap.error(f"--deadline must be > 0 seconds, got {args.deadline}")
    if args.stages is not None:
        names = [n.strip() for n in args.stages.split(",") if n.strip()]
        known = [s[0] for s in STAGES]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            ap.error(f"--stages {args.stages!r}: unknown {unknown}; expected a comma list of {known}")
        args.stages = names
    return args


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()  # the deadline counts from the command's start (torch's import included)
    args = parse_args(argv)
    if args.roofline_only:
        print(rl.table())
        return 0
    if not has_nvidia_driver():
        print(NO_CUDA, file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    STATE.autotune = args.autotune
    if args.warm:
        return warm_child(args.warm)
    chosen = [
        s
        for s in STAGES
        if (args.stages is None or s[0] in args.stages) and not (args.no_warm and s[0] == "warm")
    ]
    report = BenchReport(args.out, header(), STATE)
    report.write()
    results = run_within(chosen, report, args.deadline, start=start)
    failed = [r.name for r in results if not r.ok]
    print(
        f"\n{args.out}: {len(results) - len(failed)}/{len(results)} stages ran"
        + (f"; not: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
