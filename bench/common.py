"""Shared helpers of the CPU benchmarks: isolated runs, timing, peak memory, machine description, tables.

Every configuration runs in a fresh ``spawn``-ed process, so that its peak memory is its own:

    baseline = VmRSS after the model / inputs are built (then VmHWM is reset through /proc/self/clear_refs)
    peak     = VmHWM at the end of the run (warm-up and timed iterations included)
    delta    = peak - baseline  (activations, gradients, optimizer state, allocator slack)

If /proc/self/clear_refs cannot be written, ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is the peak
(the same number unless construction itself peaked higher). A watchdog thread aborts a run whose RSS
exceeds ``mem_cap_gb`` (exit code ``EXIT_MEM_CAP``), so a too-large configuration reports "> cap"
instead of bringing the machine down.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import multiprocessing as mp
import os
import platform
import resource
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

THREADS = 2  # the brief's CPU setting
EXIT_MEM_CAP = 86
GiB = 1024**3
MiB = 1024**2


# glibc malloc: no mmap for large blocks, never trim the heap. By default blocks above 32 MiB are mmap-ed
# and unmapped on free, so every training step page-faults (and zeroes) its large activations again.
GLIBC_NO_MMAP = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"


def setup_threads(threads: int = THREADS) -> None:
    torch.set_num_threads(threads)


def use_glibc_no_mmap() -> None:
    """Make the spawned measurement processes keep freed memory (GLIBC_TUNABLES is read at exec)."""
    os.environ["GLIBC_TUNABLES"] = GLIBC_NO_MMAP


# --------------------------------------------------------------------------- memory


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    try:
        return _status_kib("VmHWM") * 1024
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryWatchdog:
    """Ends the process (exit code EXIT_MEM_CAP) as soon as its RSS exceeds ``cap_bytes``."""

    def __init__(self, cap_bytes: int, period_s: float = 0.02):
        self.cap, self.period = cap_bytes, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            if rss_bytes() > self.cap:
                os.write(2, f"memory watchdog: RSS above {self.cap / GiB:.1f} GiB, aborting\n".encode())
                os._exit(EXIT_MEM_CAP)

    def __enter__(self) -> MemoryWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


@dataclass
class Measurement:
    """What one isolated run reports. ``status`` is "ok", "mem cap", "killed" or "error"."""

    status: str = "ok"
    times: list[float] = field(default_factory=list)  # wall seconds per timed iteration
    cpu_times: list[float] = field(default_factory=list)  # process CPU seconds (all threads) per iteration
    sys_times: list[float] = field(default_factory=list)  # of which in the kernel (page faults, zeroing)
    baseline_bytes: int = 0  # RSS after construction
    peak_bytes: int = 0  # VmHWM at the end
    extra: dict = field(default_factory=dict)
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def cpu_utilisation(self) -> float:
        """CPU seconds per wall second of the best iteration: about the thread count when the run had
        the cores to itself, well below it when other processes competed for them."""
        i = self.times.index(self.best)
        return self.cpu_times[i] / self.times[i]

    @property
    def sys_share(self) -> float:
        """Share of the best iteration's CPU time spent in the kernel: mostly page faults on memory the
        allocator returned to the OS after the previous step and now takes back (first touch zeroes it)."""
        i = self.times.index(self.best)
        return self.sys_times[i] / self.cpu_times[i] if self.sys_times and self.cpu_times[i] else 0.0

    @property
    def delta_bytes(self) -> int:
        return self.peak_bytes - self.baseline_bytes


def time_iterations(
    step: Callable[[], None], warmup: int, repeat: int, slow_s: float = 20.0
) -> tuple[list[float], list[float], list[float]]:
    """Run ``warmup`` untimed then ``repeat`` timed iterations -> (wall seconds, process CPU seconds,
    of which system seconds). If the first iteration takes longer than ``slow_s`` seconds, only one timed
    iteration follows the warm-up (bounds the run time at long L)."""
    times: list[float] = []
    cpu: list[float] = []
    system: list[float] = []
    total, i = warmup + repeat, 0
    while i < total:
        gc.collect()
        s0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        ds = resource.getrusage(resource.RUSAGE_SELF).ru_stime - s0
        if i >= warmup:
            times.append(dt)
            cpu.append(dc)
            system.append(ds)
        if i == 0 and dt > slow_s:
            total = min(total, warmup + 1)
        i += 1
    return times, cpu, system


def _child(conn, fn, kwargs, threads: int, mem_cap_bytes: int) -> None:
    setup_threads(threads)
    try:
        with MemoryWatchdog(mem_cap_bytes):
            result = fn(**kwargs)
        conn.send(result)
    except Exception:  # reported to the parent as a table cell, the run goes on
        conn.send(Measurement(status="error", message=traceback.format_exc(limit=3)))
    finally:
        conn.close()


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run_isolated(
    fn: Callable[..., Measurement], mem_cap_gb: float, threads: int = THREADS, **kwargs
) -> Measurement:
    """Run ``fn(**kwargs) -> Measurement`` in a fresh spawned process; never raises.

    The memory cap is lowered to what the machine has available (less 1 GiB) at launch, so that a
    run that would not fit is aborted by its own watchdog rather than by the kernel's OOM killer.
    """
    avail = available_bytes()
    if avail:
        mem_cap_gb = min(mem_cap_gb, avail / GiB - 1.0)
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, kwargs, threads, int(mem_cap_gb * GiB)))
    proc.start()
    send.close()
    result = None
    while result is None:
        if recv.poll(0.5):
            try:
                result = recv.recv()
            except EOFError:
                break
        elif not proc.is_alive():
            break
    proc.join()
    if result is not None:
        return result
    if proc.exitcode == EXIT_MEM_CAP:
        return Measurement(status="mem cap", message=f"RSS above the {mem_cap_gb:.1f} GiB cap")
    return Measurement(status="killed", message=f"exit code {proc.exitcode}")


def measure(
    build: Callable[[], object], step_of: Callable[[object], Callable[[], None]], warmup: int, repeat: int
):
    """In the child: build state, reset the peak, time the step. Returns a Measurement."""
    state = build()
    gc.collect()
    baseline = rss_bytes()
    reset_ok = reset_peak_rss()
    step = step_of(state)
    times, cpu, system = time_iterations(step, warmup, repeat)
    peak = peak_rss_bytes()
    return Measurement(
        times=times,
        cpu_times=cpu,
        sys_times=system,
        baseline_bytes=baseline,
        peak_bytes=peak,
        extra={"hwm_reset": reset_ok},
    )


def weight_read_floor(model: torch.nn.Module, dtype: torch.dtype = torch.float32, repeat: int = 20) -> float:
    """Seconds of one GEMV ``torch.mv(W, x)`` over a [n, 1024] matrix with n * 1024 >= the model's parameter count,
    in ``dtype`` (median of ``repeat``): the time to read every weight once, the floor of a decode step
    that reads all of them per token."""
    numel = sum(p.numel() for p in model.parameters())
    w = torch.randn((numel + 1023) // 1024, 1024).to(dtype)
    x = torch.randn(1024).to(dtype)
    times = []
    for _ in range(repeat + 2):
        t0 = time.perf_counter()
        torch.mv(w, x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


# --------------------------------------------------------------------------- reporting


def code_fingerprint() -> str:
    """sha256 (12 hex) of the benchmarked sources (mega_suite/, kernels/) and their newest mtime, so a
    results table can be matched to the code it measured."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(p for d in ("mega_suite", "kernels") for p in (root / d).rglob("*.py"))
    digest = hashlib.sha256()
    for p in files:
        digest.update(str(p.relative_to(root)).encode())
        digest.update(p.read_bytes())
    newest = max(p.stat().st_mtime for p in files)
    stamp = datetime.datetime.fromtimestamp(newest).isoformat(timespec="seconds")
    return f"code sha256 {digest.hexdigest()[:12]} (mega_suite/ + kernels/, newest file {stamp})"


def machine_description(threads: int = THREADS) -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = f"{names[0]} x {len(names)} logical CPUs" if names else cpu
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    tunables = os.environ.get("GLIBC_TUNABLES")
    return (
        f"{datetime.datetime.now().isoformat(timespec='seconds')} | {cpu}, {mem:.0f} GiB RAM | "
        f"torch {torch.__version__}, {threads} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()} | load average {load}"
        f"{f' | GLIBC_TUNABLES={tunables}' if tunables else ''}\n{code_fingerprint()}"
    )


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def fmt_bytes(b: float | None, unit: str = "GiB") -> str:
    if b is None:
        return "-"
    return f"{b / GiB:.2f} GiB" if unit == "GiB" else f"{b / MiB:.0f} MiB"


def fmt_ratio(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}x"


def fmt_length(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def parse_lengths(text: str) -> list[int]:
    """'4K,8K,16384' -> [4096, 8192, 16384]."""
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        out.append(int(float(item[:-1]) * 1024) if item.endswith("K") else int(item))
    return out
