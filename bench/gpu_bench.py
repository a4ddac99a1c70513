"""``make gpu-bench``: the GPU path's speed against its roofline and the targets of issue 29, in <= 5 minutes.

    python -m bench.gpu_bench                     # every stage; writes bench/GPU_RESULTS.md stage by stage
    python -m bench.gpu_bench --roofline-only     # the analytic roofline (spec-sheet ceilings); any machine
    python -m bench.gpu_bench --stages ceilings,attention --out /tmp/r.md --deadline 120
    python -m bench.gpu_bench --autotune          # Triton's autotuners instead of fixed tiles (minutes more)
    python -m bench.gpu_bench --stages train_step --train-args "model.num_layers=4 trainer.float32_matmul_precision=high"

Runs on the GPU machine's own python3 (torch, Triton and Lightning preinstalled, no project virtual environment):
every stage but ``train_step`` imports nothing outside torch, Triton and this repository's kernels and models;
``train_step`` goes through the suite's configuration and Lightning module, so it also needs omegaconf, which
the lent machine lacks (carry it: bench/README.md); without it that stage alone fails, saying so.

Stages, in order, each written to the report as it ends (a run cut off still leaves every finished stage),
each stopped at its budget and failing alone; the whole run stops starting stages at ``--deadline`` seconds
(default 285) after ``main`` started, so the command fits a 5-minute slot:

0. ``warm`` (65 s): six child processes (``--warm GROUP``) run the benchmark's Triton kernels once, so that
   Triton compiles them in parallel into its on-disk cache (it compiles serially in the launching process);
   nothing is timed. ``--no-warm`` skips it.
1. ``ceilings`` (20 s): device copy bandwidth (1 GiB, bytes read + written), dense bf16 GEMM rate and
   float32 SGEMM rate (TF32 off), n 8192, random data; every floor after this divides by these.
2. ``kernels`` (60 s): TimestepNorm (bf16 and float32), CEMA, Q/K norm + RoPE (both kernel variants) at B1
   L32K and the 7B widths, forward and forward + backward; the decode GEMV at two 7B shapes, forward.
3. ``attention`` (60 s): every attention path side by side at the 7B's 4K chunk (dk 256, dv 256 and 2048,
   causal; ``bench.attention_gpu``'s comparison), SDPA flash beside them, and the path the dispatcher
   (``kernels.attention.attention_path``) picks, so its thresholds can be settled.
4. ``block_eager`` (45 s): one 7B-width block, Megalodon beside Llama-2, bf16-mixed, forward + backward, at
   4K and 32K.
5. ``block_variants`` (45 s): Megalodon's eager block under each kernel variant (attention's causal row
   blocks and saved P, the Q/K kernel's ``rows`` variant), in one process with the default first and last, to
   choose the defaults from the block.
6. ``train_step`` (60 s): the whole model through the suite's own training step, as ``run.py`` builds it
   (``load_config`` of ``llm_7b`` with 2 layers, ``make_plan``, ``build_run_module``, ``build_trainer``:
   bf16-mixed, fused AdamW, clipping, the run's callbacks; one GPU, one sequence per step, random tokens),
   Megalodon and the parameter-matched Llama at 4K and 32K: tokens/s, MFU against the measured GEMM rate,
   peak memory, and the Megalodon / Llama ratio beside the block's.
7. ``block_compiled`` (60 s): the same through ``torch.compile`` (Inductor defaults, as
   ``trainer.compile=true`` compiles each block) at 4K.
8. ``block_reduce_overhead`` (50 s): ``torch.compile(mode="reduce-overhead")`` (CUDA graphs,
   ``trainer.compile_mode=reduce-overhead``) at 4K, where launch overhead matters.
9. ``block_compiled_long`` (60 s): ``torch.compile`` at 32K (no target: last, the first cut by the deadline).

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
import gc
import hashlib
import importlib.util
import os
import platform
import shlex
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
# Issue 37's.
TARGET_QK_FLOOR = 0.7  # Q/K norm + RoPE fwd+bwd: floor / measured
TARGET_TRAIN_RATIO = 0.05  # whole model Megalodon / Llama within 5% of the block's ratio

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
    # train_step: the recipe and overrides it runs (before TRAIN_FIXED and --train-args), its lengths, and the
    # optimizer steps run before timing (the first compiles and allocates) and timed
    train_recipe: str = "llm_7b"
    train_overrides: tuple[str, ...] = ("model.num_layers=2", "trainer.gradient_checkpointing=false")
    train_lengths: tuple[int, ...] = (4096, 32768)
    train_steps: tuple[int, int] = (2, 4)


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
    block_ms: dict[tuple[str, int, str], float | None] = field(default_factory=dict)  # (mode, L, kind) -> ms
    train_args: tuple[str, ...] = ()  # --train-args: more overrides of the train_step runs

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
        lead = "## Targets (issues 29 and 37)\n\n" + (
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


# The Q/K kernel's variants timed alone (kernels.qk_norm_rope.triton settings); the block_variants stage times
# the rows variant inside the block, where the choice is made.
QK_VARIANTS: tuple[tuple[str, dict], ...] = (
    ("", {}),
    ("rows", {"VARIANT": "rows"}),
    ("rows, bwd tile 2048 x 8 warps", {"VARIANT": "rows", "ROWS_BWD_TILE": 2048, "ROWS_BWD_WARPS": 8}),
)


def _qk_row(work: rl.Work, name: str = "", settings: dict | None = None) -> tuple[list[str], float | None]:
    """A row for the Q/K kernel under ``settings`` of kernels.qk_norm_rope.triton, and floor / measured."""
    import torch

    from kernels.qk_norm_rope import qk_norm_rope

    z, g = STATE.sizes, _generator()
    h, zd = z.heads, z.z_dim // z.heads
    q_in = _randn(1, z.kernel_length, h, zd, g=g).to(_low()).requires_grad_()
    gamma, beta = ((0.1 * _randn(2, h * zd, g=g)).requires_grad_() for _ in "gb")
    cts = [torch.randn_like(q_in) for _ in "qk"]

    def run():
        return qk_norm_rope(q_in, gamma, beta, 1e5, 1e-5, z.chunk, 0, _low())

    if name:  # its own line in the roofline table
        work = rl.Work(f"{work.name}, {name}", flops=work.flops, simt_flops=work.simt_flops, bytes=work.bytes)
    with _settings({"kernels.qk_norm_rope.triton": settings or {}}):
        with torch.no_grad():
            fwd = try_ms(run)
        both = try_ms(lambda: torch.autograd.backward(run(), cts), (q_in, gamma, beta))
    share = None if both is None else work.floor_s(STATE.rates()) * 1e3 / both
    return [work.name, fmt(fwd), fmt(both), *STATE.floor_cells(work, both), _bandwidth(work, both)], share


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
    rule = lambda v: v >= TARGET_QK_FLOOR  # noqa: E731
    for name, settings in QK_VARIANTS:
        row, share = _qk_row(works["qk_norm_rope"], name, settings)
        rows.append(row + [f">= {TARGET_QK_FLOOR:.0%} of its floor: {_verdict(share, rule)}"])
        STATE.target(f"Q/K norm + RoPE fwd+bwd >= {TARGET_QK_FLOOR:.0%} of its floor (floor / measured), {name or 'the default'}",
                     fmt(None if share is None else 100 * share, 0, "%"), _ok(share, rule), "kernels")  # fmt: skip
        _empty_cache()
    rows.append(_gemv_row(works["gemv_ffn_in"], 2 * z.ffn_dim, z.dim) + ["-"])
    rows.append(_gemv_row(works["gemv_ffn_out"], z.dim, z.ffn_dim) + ["-"])
    _empty_cache()
    body = (
        "Each kernel through its dispatcher (the Triton path on CUDA), forward and forward + backward into every "
        "input; TimestepNorm also in float32 (the block runs it and CEMA as float32 islands); CEMA from its raw "
        "parameters as the model trains it; Q/K norm + RoPE under each kernel variant (`rows`: whole tokens per "
        "program, a cos / sin table); the GEMV forward only (decoding). Floors and FLOP / byte counts: "
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
            STATE.block_ms[(mode, length, kind)] = t[kind]
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


# The kernel choices that timing a kernel alone cannot settle (on an H200 one square was faster alone, the
# block slower with it), each as settings of the modules named, timed inside the block.
BLOCK_VARIANTS: tuple[tuple[str, dict[str, dict]], ...] = (
    ("default", {}),
    ("one square", {"kernels.attention.probs": {"CAUSAL_ROW_BLOCKS": 1}}),
    ("halves", {"kernels.attention.probs": {"CAUSAL_ROW_BLOCKS": 2}}),
    ("saved P", {"kernels.attention.probs": {"SAVE_PROBS": True}}),
    ("Q/K rows", {"kernels.qk_norm_rope.triton": {"VARIANT": "rows"}}),
    ("default again", {}),
)


@contextlib.contextmanager
def _settings(settings: dict[str, dict]):
    """Module attributes set for the block: {module name: {attribute: value}}, restored after."""
    old = []
    try:
        for module_name, values in settings.items():
            module = importlib.import_module(module_name)
            for name, value in values.items():
                old.append((module, name, getattr(module, name)))
                setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(old):
            setattr(module, name, value)


def stage_block_variants() -> Outcome:
    """Megalodon's eager block at each length under each kernel variant, in one process, with the default
    timed first and last: its drift says how large a difference must be to mean something."""
    rows = []
    for length in STATE.sizes.block_lengths:
        step, grads = block_step("megalodon", length, "eager")
        base = None
        for name, settings in BLOCK_VARIANTS:
            with _settings(settings):
                ms = try_ms(step, grads, rep_ms=300)
            base = ms if base is None else base
            rows.append([f"{length // 1024}K" if length >= 1024 else str(length), name, fmt(ms),
                         fmt(None if ms is None or base is None else ms / base, 3)])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
        del step, grads
        _empty_cache()
    body = (
        "Megalodon's block as in block_eager, under each kernel variant (`kernels.attention.probs` settings: "
        "causal row blocks, P saved for backward; `kernels.qk_norm_rope.triton.VARIANT`: the Q/K kernel's rows "
        "variant); the default first and last.\n\n"
    )
    return Outcome(True, body + markdown_table(["L", "attention", "ms", "/ default"], rows))


def stage_block_reduce_overhead() -> Outcome:
    length = min(STATE.sizes.block_lengths)
    rows, ratios = _block_table("reduce-overhead", (length,))
    STATE.target(f"Megalodon / Llama reduce-overhead at L {length} (no target)", fmt(ratios.get(length), 2), None,
                 "block_reduce_overhead")  # fmt: skip
    return _block_outcome("reduce-overhead", rows, ratios)


# the whole model through the suite's training step --------------------------------------------------------

# What train_step sets on top of the recipe: one GPU, one sequence per optimizer step (no accumulation towards
# the recipe's 4M-token batch), no validation, no progress bar in the log.
TRAIN_FIXED = (
    "trainer.devices=1", "trainer.strategy=auto", "trainer.global_batch_tokens=0",
    "trainer.accumulate_grad_batches=1", "trainer.limit_val_batches=0", "trainer.progress_bar=false",
    "data.batch_size=1",
)  # fmt: skip
TRAIN_HEADERS = ["L", "model", "parameters", "step ms", "tokens/s", "MFU", "peak GiB", "layer ms",
                 "layers x layer ms", "rest ms", "s (incl. build)"]  # fmt: skip
TRAIN_NEEDS = ("omegaconf", "lightning")


def train_argv(arch: str, length: int, run_root: Path) -> list[str]:
    """The command line (``run.py``'s key=value list) of one train_step run."""
    z = STATE.sizes
    return [
        f"recipe={z.train_recipe}", *z.train_overrides, *TRAIN_FIXED, f"model.arch={arch}",
        f"data.options.seq_len={length}", f"trainer.accelerator={'gpu' if STATE.device == 'cuda' else 'cpu'}",
        f"trainer.max_steps={sum(z.train_steps)}", f"run_root={run_root}", *STATE.train_args,
    ]  # fmt: skip


def _random_tokens(vocab: int, length: int, batch: int, steps: int, seed: int):
    """A data module of ``steps`` batches of random tokens, ``{"input", "target"}`` [B, L] int64 as the
    pretraining loader yields them (the corpus and its tokenizer are not on a lent machine)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    class RandomTokens(L.LightningDataModule):
        vocab_size = vocab

        def train_dataloader(self):
            tokens = torch.randint(
                0, vocab, (steps * batch, length + 1), generator=torch.Generator().manual_seed(seed)
            )
            rows = [{"input": t[:-1], "target": t[1:]} for t in tokens]
            return DataLoader(rows, batch_size=batch, pin_memory=STATE.device == "cuda")

    return RandomTokens()


def _step_clock(at_end: Callable[[object, object], None]):
    """A callback noting when each training batch ends (device synchronised): the interval between two ends is
    one whole step (data, forward, backward, clipping, optimizer, logging and every other hook). ``at_end``
    runs when training ends, before Lightning's teardown moves the module to the host."""
    import lightning as L

    class StepClock(L.Callback):
        def __init__(self):
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
            _sync()
            self.ends.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module) -> None:
            at_end(trainer, pl_module)

    return StepClock()


def _layer_ms(layer, length: int, width: int, precision: str) -> float | None:
    """One of the model's own layers, forward + backward at batch 1 under the run's autocast, as block_step."""
    import torch

    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))
    x = _randn(1, length, width).requires_grad_()
    ct = _randn(1, length, width)

    def step():
        with torch.autocast(STATE.device, dtype or torch.bfloat16, enabled=dtype is not None):
            out = layer(x)
        (out[0] if isinstance(out, tuple) else out).backward(ct)

    return try_ms(step, [x, *layer.parameters()], rep_ms=300)


def train_run(arch: str, length: int, folder: Path) -> dict:
    """One short fit of the suite's Lightning module at ``length`` tokens per sequence, built as ``run.py``
    builds it (the plan, ``build_run_module``, ``build_trainer`` and its callbacks; no checkpoint is written:
    a save is not a step): the median step after ``train_steps[0]`` warm-up steps, the peak memory, and one of
    the model's layers timed alone when training ends."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from mega_suite.config import load_config
    from mega_suite.config.run_plan import make_plan
    from mega_suite.models import count_parameters
    from mega_suite.training.runner import build_run_module, build_trainer, quiet_lightning

    warm, timed = STATE.sizes.train_steps
    if warm < 1 or timed < 1:
        raise ValueError(
            f"train_steps must be (warm-up >= 1, timed >= 1) optimizer steps, got {(warm, timed)}"
        )
    first = time.perf_counter()
    plan = make_plan(load_config(train_argv(arch, length, folder / "runs")))
    cfg = plan.cfg
    data = _random_tokens(plan.data_kwargs["vocab_size"], length, cfg.data.batch_size, warm + timed, cfg.seed)
    plan = plan.with_data(data)
    quiet_lightning()
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = build_run_module(plan)
    result: dict = dict(layers=plan.model.num_layers, params=count_parameters(module.model),
                        flops_per_token=plan.flops_per_token)  # fmt: skip

    def at_end(trainer, pl_module) -> None:
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if STATE.device == "cuda" else None
        for opt in trainer.optimizers:  # not needed any more; teardown would copy them to the host
            opt.state.clear()
        pl_module.zero_grad(set_to_none=True)
        result["layer_ms"] = _layer_ms(
            pl_module.model.layers[0], length, plan.model.model_dim, trainer.precision
        )

    clock = _step_clock(at_end)
    trainer = build_trainer(plan, folder / arch, [clock])
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelCheckpoint)]
    if STATE.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer.fit(module, datamodule=data)
    finally:
        del trainer, module
        gc.collect()
        _empty_cache()
    ends = clock.ends
    if len(ends) != warm + timed or "layer_ms" not in result:
        raise RuntimeError(f"the fit ran {len(ends)} steps, {warm + timed} were asked")
    step_s = statistics.median(b - a for a, b in zip(ends[warm - 1 : -1], ends[warm:]))
    result.update(step_ms=1e3 * step_s, tokens_per_s=cfg.data.batch_size * length / step_s,
                  seconds=time.perf_counter() - first)  # fmt: skip
    return result


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def stage_train_step() -> Outcome:
    """The whole model through the suite's training step, Megalodon beside the parameter-matched Llama, at
    each length: tokens/s, MFU against the measured GEMM rate, peak memory, and the Megalodon / Llama ratio
    beside the eager block's (block_eager, this process); the step's time beyond its layers' own times is the
    rest: embedding, head and loss, optimizer, clipping, data and Lightning's hooks. Stopped at its budget, it
    reports the runs that finished."""
    import tempfile

    import torch

    missing = [m for m in TRAIN_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        return Outcome(False, f"Not run: the suite's training step needs {', '.join(missing)}, which this "
                              "python lacks (carry it: bench/README.md#the-gpu-machine).")  # fmt: skip
    rows, lines, stopped = [], [], None
    precision = torch.get_float32_matmul_precision()  # build_trainer sets the run's; later stages get theirs
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_bench_train_") as tmp:
            for length in STATE.sizes.train_lengths:
                got = {}
                for arch in ("megalodon", "llama"):
                    try:
                        got[arch] = train_run(arch, length, Path(tmp) / f"{arch}{length}")
                    except Exception as e:  # noqa: BLE001 -- a "-" row; the next run still goes
                        if _stage_timeout(e):
                            raise
                        print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                              flush=True)  # fmt: skip
                        _empty_cache()
                    rows.append(_train_row(length, arch, got.get(arch)))
                    print(" | ".join(rows[-1]), flush=True)
                lines.append(_train_ratio(length, got))
    except Exception as e:  # noqa: BLE001 -- the stage's budget: the finished runs are kept
        if not _stage_timeout(e):
            raise
        stopped = f"Stopped at the stage's budget ({e}); the runs above finished."
    finally:
        torch.set_float32_matmul_precision(precision)
    z = STATE.sizes
    body = (
        f"The suite's own training step, built as `run.py` builds it: `recipe={z.train_recipe}` with "
        f"{' '.join(f'`{o}`' for o in z.train_overrides + STATE.train_args)}, and `model.arch=megalodon` / `llama` "
        f"(the Llama matched in parameters to the recipe's Megalodon), one GPU, one sequence per optimizer step, "
        f"random tokens; {z.train_steps[0]} warm-up steps, then the median of {z.train_steps[1]} (batch end to batch "
        "end: data, forward, backward, clipping, AdamW, logging and every hook; no checkpoint is written). MFU: "
        "the plan's FLOPs per token x tokens/s / the dense GEMM rate measured in `ceilings`. Layer ms: one of the "
        "model's own layers, forward + backward, timed alone after the fit as `block_eager` times a block; rest = "
        "step - layers x layer: embedding, head and loss, optimizer, clipping, data and Lightning. The matched "
        "Llama's layer is not `block_eager`'s Llama-2-7B block (its FFN width fills the parameter budget of "
        "this depth), so both ratios are given.\n\n"
    )
    body += (
        markdown_table(TRAIN_HEADERS, rows)
        + "\n\n"
        + "\n".join(lines)
        + (f"\n\n{stopped}" if stopped else "")
    )
    return Outcome(stopped is None, body)


def _train_row(length: int, arch: str, r: dict | None) -> list[str]:
    """A row of the train_step table (dashes for a run that failed); records Megalodon's MFU."""
    if r is None:
        return [_length(length), arch] + ["-"] * (len(TRAIN_HEADERS) - 2)
    layers_ms = None if r["layer_ms"] is None else r["layers"] * r["layer_ms"]
    mfu = r["tokens_per_s"] * r["flops_per_token"] / STATE.rates().bf16_flops_per_s
    if arch == "megalodon":
        STATE.target(f"Megalodon MFU through the training step at L {length} (reported)", f"{mfu:.1%}", None,
                     "train_step")  # fmt: skip
    return [_length(length), f"{arch}, {r['layers']} layer{'s' * (r['layers'] != 1)}", _count(r["params"]),
            fmt(r["step_ms"]), f"{r['tokens_per_s']:,.0f}", f"{mfu:.1%}", fmt(r["peak_gib"], 1), fmt(r["layer_ms"]),
            fmt(layers_ms), fmt(None if layers_ms is None else r["step_ms"] - layers_ms), f"{r['seconds']:.0f}"]  # fmt: skip


def _length(length: int) -> str:
    return f"{length // 1024}K" if length >= 1024 else str(length)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _train_ratio(length: int, got: dict[str, dict]) -> str:
    """The line giving the whole model's Megalodon / Llama ratio beside the block's; records the target."""
    mega, llama = got.get("megalodon", {}), got.get("llama", {})
    whole = _ratio(mega.get("step_ms"), llama.get("step_ms"))
    block = _ratio(*(STATE.block_ms.get(("eager", length, k)) for k in ("megalodon", "llama")))
    own = _ratio(mega.get("layer_ms"), llama.get("layer_ms"))
    ok = None if whole is None or block is None else abs(whole / block - 1) <= TARGET_TRAIN_RATIO
    STATE.target(f"Megalodon / Llama through the training step within {TARGET_TRAIN_RATIO:.0%} of the eager "
                 f"block's at L {length}", f"{fmt(whole, 2)} (block {fmt(block, 2)})", ok, "train_step")  # fmt: skip
    return (f"- L {length}: Megalodon / Llama {fmt(whole, 2)} through the training step; {fmt(block, 2)} for one "
            f"eager block (`block_eager`: Llama-2-7B's); {fmt(own, 2)} for the two models' own layers")  # fmt: skip


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
            for variant, settings in QK_VARIANTS:
                _qk_row(works["qk_norm_rope"], variant, settings)
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
    ("block_variants", 45, stage_block_variants),
    ("train_step", 60, stage_train_step),
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
    ap.add_argument("--train-args", default="",
                    help="more key=value overrides of the train_step runs, e.g. 'model.num_layers=4'")  # fmt: skip
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
    STATE.train_args = tuple(shlex.split(args.train_args))
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
