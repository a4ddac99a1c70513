"""``make gpu-check``: one command that proves the GPU path correct on one H100 in one 10-minute call.

    python -m bench.gpu_check                 # every stage; writes bench/GPU_CHECK.md
    python -m bench.gpu_check --stages model_step --out /tmp/r.md
    python -m bench.gpu_check --serial        # listops after the others rather than beside them

Speed against the roofline and the targets is ``make gpu-bench`` (bench/gpu_bench.py, bench/GPU_RESULTS.md);
this command checks correctness. Each stage's result (pass / fail, numbers) is written to the Markdown report
as soon as it ends, so a crash or a timeout still leaves a partial report; each stage is stopped at its budget
(+15 s) and fails alone. By default the listops run trains in a child process beside the other stages.
Budgets are for one H100 (80 GB):

1. ``cuda_tests``  (5.8 min)  the kernel tests natively on CUDA: ``CUDA_TEST_FILES`` (bf16, L = 32K and
   the GPU-only cases that skip on CPU; fixed tiles except the tests marked ``autotune``) with pytest-xdist
   workers where installed, and anything marked ``gpu``; no test may skip for want of CUDA.
2. ``model_step``  (2 min)  one full training step (forward loss, every parameter gradient) of a small
   real LM (2 layers, D 512, L 4096, C 1024) and classifier (2 layers, D 256, L 4096, C 1024, padding),
   fp32 and bf16-mixed (``torch.autocast("cuda", torch.bfloat16)``), Triton kernels (fixed attention
   tiles) against the PyTorch references (``kernels.dispatch.force_reference``). Rule (mamba's): for the
   loss and every gradient, ``err(triton) <= 2 err(reference) + atol``, each err = max|. - float64| /
   max|float64| against a float64 run of the same model.
3. ``listops``     (5.5 min)  ``run.py recipe=lra_listops`` for 500 bf16-mixed steps on the GPU (data
   generated when absent, about 1.3 min), a short validation; loss-vs-step table and gpu_listops_loss.png
   beside the report. Pass: finishes, finite losses, mean loss of the last 50 steps below the first 50's.
   It needs omegaconf and soundfile, which the lent machine's python3 lacks (carry them as wheels).

The command exits 1 if any stage fails, and exits 2 at once, before importing torch, without an NVIDIA
driver (and after importing it, without a CUDA device).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "GPU_CHECK.md"
REPORT_DIR = DEFAULT_OUT.parent  # the loss curve goes beside the report (main sets it from --out)
NO_CUDA = (
    "bench.gpu_check needs a CUDA GPU (an NVIDIA driver and torch.cuda.is_available()); none found here."
)


# ------------------------------------------------------------------------------------------------ runner


@dataclass
class Outcome:
    """What a stage returns: pass / fail, Markdown body, headline numbers."""

    ok: bool
    body: str = ""
    numbers: dict = field(default_factory=dict)


@dataclass
class StageResult:
    name: str
    ok: bool
    seconds: float
    budget_s: float
    body: str
    numbers: dict


class Report:
    """The Markdown file, rewritten in full after each stage (a crash leaves every finished stage)."""

    def __init__(self, path: Path, header: str):
        self.path, self.header, self.sections = path, header, []

    def add(self, result: StageResult) -> None:
        verdict = "PASS" if result.ok else "FAIL"
        head = f"## {result.name}: {verdict} ({result.seconds:.0f} s, budget {result.budget_s:.0f} s)"
        self.sections.append(f"{head}\n\n{result.body.strip()}\n")
        self.write()

    def write(self, footer: str = "") -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = "\n".join([self.header, *self.sections, footer]).rstrip() + "\n"
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.path)


STAGE_GRACE_S = 15


class StageTimeout(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise StageTimeout in the stage once ``seconds`` have passed (SIGALRM; main thread only): a stage
    that hangs or runs long fails alone, and the next stage still gets its time on a lent machine."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise StageTimeout(f"stage stopped after its budget + {STAGE_GRACE_S} s ({seconds:.0f} s)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_stages(
    stages: list[tuple[str, float, Callable[[], Outcome]]],
    report: Report,
    results: list[StageResult] | None = None,
    summary: bool = True,
) -> list[StageResult]:
    """Run each (name, budget seconds, fn) in order; an exception or a timeout fails its stage only."""
    results = [] if results is None else results
    for name, budget, fn in stages:
        print(f"\n=== {name} (budget {budget:.0f} s)", flush=True)
        start = time.perf_counter()
        try:
            with _deadline(budget + STAGE_GRACE_S):
                out = fn()
        except Exception:  # noqa: BLE001 -- the report records it; the next stage still runs
            out = Outcome(False, "```\n" + traceback.format_exc()[-6000:] + "\n```")
        result = StageResult(name, bool(out.ok), time.perf_counter() - start, budget, out.body, out.numbers)
        report.add(result)
        print(f"=== {name}: {'PASS' if result.ok else 'FAIL'} in {result.seconds:.0f} s", flush=True)
        results.append(result)
    if summary:
        write_summary(report, results)
    return results


def write_summary(report: Report, results: list[StageResult]) -> None:
    total = sum(r.seconds for r in results)
    summary = "| stage | result | seconds | budget |\n|---|---|---|---|\n" + "\n".join(
        f"| {r.name} | {'PASS' if r.ok else 'FAIL'} | {r.seconds:.0f} | {r.budget_s:.0f} |" for r in results
    )
    report.write(f"## Summary\n\n{summary}\n\nTotal {total / 60:.1f} min (stage seconds summed).")


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def has_nvidia_driver() -> bool:
    """Cheap test before importing torch: the NVIDIA kernel driver's files."""
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


# ------------------------------------------------------------------------------------------------ stages


def _python() -> str:
    return sys.executable


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    """(exit code, stdout + stderr); past ``timeout`` the command is killed and what it printed so far is
    returned with exit code 124 (a stage that runs long still reports which tests or steps it reached)."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        text = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
        return 124, text + f"\n[killed after {timeout:.0f} s]\n"
    return proc.returncode, proc.stdout + proc.stderr


def _xdist_workers() -> list[str]:
    """``-n N`` for pytest-xdist where it is installed: the kernel tests spend most of their time compiling
    (one CPU core per compile), so N workers on one GPU finish several times sooner."""
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(max(1, min(6, (os.cpu_count() or 2) // 3)))]


def _pytest(args: list[str], timeout: float) -> tuple[int, str]:
    return _run(
        [
            _python(),
            "-m",
            "pytest",
            "-q",
            "-rfEs",
            "--show-capture=no",  # a failure's captured logs (torch's DEBUG trace lines) buried its error
            "-p",
            "no:benchmark",
            "-p",
            "no:cacheprovider",
            *_xdist_workers(),
            *args,
        ],
        timeout,
    )


CUDA_TEST_FILES = (
    "tests/kernels/test_triton_attention.py",
    "tests/kernels/test_triton_cema.py",
    "tests/kernels/test_triton_timestep_norm.py",
    "tests/kernels/test_triton_gemv.py",
    "tests/kernels/test_attention_probs.py",
    "tests/kernels/test_qk_norm_rope.py",
    "tests/kernels/test_timestep_norm_scan.py",
    "tests/kernels/test_cema_coefficients.py",
    "tests/kernels/test_cema_tensor_cores.py",
)


def stage_cuda_tests() -> Outcome:
    """The kernel tests on CUDA (natively: conftest sets TRITON_INTERPRET only without CUDA) and the
    tests marked ``gpu``; a skip that says CUDA is missing is a failure here."""
    rc, out = _pytest(list(CUDA_TEST_FILES), timeout=220)  # the five newest files: about 60 s on an H200
    rc_gpu, out_gpu = _pytest(["-m", "gpu", "tests"], timeout=120)  # Inductor compiles (test_compile)
    lines = (out + out_gpu).splitlines()
    summary = [line for line in lines if re.search(r"\d+ (passed|failed|error)|^(FAILED|ERROR) ", line)]
    cuda_skips = [line for line in lines if "SKIPPED" in line and "CUDA" in line]
    ok = rc == 0 and rc_gpu in (0, 5) and not cuda_skips  # 5: no test is marked gpu
    body = "`pytest " + " ".join(CUDA_TEST_FILES) + "` and `pytest -m gpu tests`:\n\n```\n"
    body += "\n".join(summary + cuda_skips) + "\n```\n"
    if not ok:
        errors = [line for line in lines if line.startswith("E ")]
        if errors:  # each failure's exception lines first: the tail below may be all warnings
            body += "\nErrors:\n\n```\n" + "\n".join(errors)[-4000:] + "\n```\n"
        kept = [line for line in lines if "PytestBenchmarkWarning" not in line and "warner(" not in line]
        body += "\nOutput tail:\n\n```\n" + "\n".join(kept)[-5000:] + "\n```\n"
    return Outcome(ok, body, {"summary": summary})


# model step -------------------------------------------------------------------------------------------------

ATOL = {"fp32": 1e-5, "bf16-mixed": 1e-3}  # on errors relative to max|float64|


def _model_step_tiles():
    """Fixed attention tiles for this stage: it checks numbers, not speed, and the autotuner would compile
    ~30 configurations for each of its 4 (model, precision) keys (minutes; the kernels and block stages and
    the listops run use the autotuner)."""
    from kernels.attention import triton as attention_triton

    return attention_triton.KernelConfig(block_m=64, block_n=64, block_dv=64, num_warps=4, num_stages=2)


def _at_least_fp32(t):
    """bf16 logits up to float32; float64 logits (the truth run) stay float64 (a .float() here made the
    "float64" loss and every gradient of the truth run pass through float32 rounding)."""
    import torch

    return t if t.dtype == torch.float64 else t.float()


def _model_case(task: str):
    """(model, inputs, loss function) of a small real model; parameters float32, seeded."""
    import torch
    import torch.nn.functional as F

    from mega_suite import get_config
    from mega_suite.models import build_model

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    length, chunk = 4096, 1024
    if task == "lm":
        cfg = get_config(
            "megalodon_200m", num_layers=2, model_dim=512, num_heads=2, z_dim=256, value_dim=1024,
            ffn_hidden_dim=1024, chunk_size=chunk, norm_num_groups=32, vocab_size=1000,
        )  # fmt: skip
        tokens = torch.randint(0, 1000, (2, length + 1), generator=g)
        inputs = (tokens[:, :-1],)

        def loss_fn(model, x):
            logits, _ = model(x)
            return F.cross_entropy(_at_least_fp32(logits).flatten(0, 1), tokens[:, 1:].to(x.device).flatten())

    else:
        cfg = get_config(
            "lra_listops", num_layers=2, model_dim=256, num_heads=1, z_dim=64, value_dim=512,
            ffn_hidden_dim=512, chunk_size=chunk, norm_num_groups=32, dropout=0.0, num_classes=10, vocab_size=32,
        )  # fmt: skip
        tokens = torch.randint(1, 32, (2, length), generator=g)
        pad = torch.zeros(2, length, dtype=torch.bool)
        pad[1, length - 700 :] = True  # one padded row
        labels = torch.tensor([3, 7])
        inputs = (tokens, pad)

        def loss_fn(model, x, padding):
            return F.cross_entropy(_at_least_fp32(model(x, padding)), labels.to(x.device))

    return build_model(cfg), inputs, loss_fn


def _step(model, inputs, loss_fn, precision: str, reference: bool):
    """Loss and gradients {name: tensor} of one forward + backward, on the requested kernel path."""
    import torch

    from kernels import dispatch
    from kernels.attention import triton as attention_triton

    dispatch.force_reference(reference)
    tiles = attention_triton.kernel_config(None if reference else _model_step_tiles())
    try:
        model.zero_grad(set_to_none=True)
        ctx = (
            torch.autocast("cuda", torch.bfloat16)
            if precision == "bf16-mixed"
            else torch.autocast("cuda", enabled=False)
        )
        with ctx, tiles:
            loss = loss_fn(model, *inputs)
            loss.backward()
        grads = {
            n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        return loss.detach().double(), grads
    finally:
        dispatch.force_reference(None)


def _rel_err(x, truth) -> float:
    return float((x - truth).abs().max() / truth.abs().max().clamp(min=1e-30))


def stage_model_step() -> Outcome:
    """Triton vs reference for one training step of an LM and a classifier, fp32 and bf16-mixed."""
    import copy

    import torch

    rows, ok = [], True
    for task in ("lm", "classifier"):
        model, inputs, loss_fn = _model_case(task)
        model.train()
        inputs = tuple(t.cuda() for t in inputs)
        truth_model = copy.deepcopy(model).double().cuda()
        truth = _step(truth_model, inputs, loss_fn, "fp32", reference=True)
        del truth_model
        model = model.cuda()
        for precision in ("fp32", "bf16-mixed"):
            ref = _step(model, inputs, loss_fn, precision, reference=True)
            tri = _step(model, inputs, loss_fn, precision, reference=False)
            atol = ATOL[precision]
            checks = [("loss", ref[0], tri[0], truth[0])]
            checks += [(name, ref[1][name], tri[1][name], truth[1][name]) for name in truth[1]]
            failed, worst = [], ("", 0.0, 0.0)
            for name, r, t, t64 in checks:
                e_ref, e_tri = _rel_err(r, t64), _rel_err(t, t64)
                if not e_tri <= 2 * e_ref + atol:
                    failed.append(f"{name} ({e_tri:.2e} > 2 x {e_ref:.2e} + {atol:g})")
                if e_tri - 2 * e_ref >= worst[2] - 2 * worst[1] or not worst[0]:
                    worst = (name, e_ref, e_tri)
            ok &= not failed
            loss_err = (_rel_err(ref[0], truth[0]), _rel_err(tri[0], truth[0]))
            rows.append([
                task, precision, f"{float(truth[0]):.5f}", f"{loss_err[0]:.1e}", f"{loss_err[1]:.1e}",
                f"{worst[0]} {worst[1]:.1e} / {worst[2]:.1e}", len(checks), "PASS" if not failed else "FAIL: " + "; ".join(failed[:5]),
            ])  # fmt: skip
            print(" | ".join(map(str, rows[-1])), flush=True)
        del model
        torch.cuda.empty_cache()
    body = (
        "One training step, Triton kernels vs the PyTorch references; errors are max|x - x64| / max|x64| "
        "against a float64 run (reference kernels) of the same weights and batch. Rule: "
        "err(triton) <= 2 err(reference) + atol (fp32 1e-5, bf16-mixed 1e-3) for the loss and every gradient.\n\n"
    )
    headers = [
        "model",
        "precision",
        "loss (f64)",
        "loss err ref",
        "loss err triton",
        "tightest: name ref / triton",
        "checked",
        "result",
    ]
    return Outcome(ok, body + markdown_table(headers, rows))


# listops ----------------------------------------------------------------------------------------------------

LISTOPS_STEPS = 500
LISTOPS_TIMEOUT_S = float(os.environ.get("MEGA_LISTOPS_TIMEOUT", 320))  # a shorter lease sets it lower
TRAIN_LINE = re.compile(r"\[train\] step (\d+)(?:/\d+)?\s+loss\(mean\) ([-+\d.eEinfa]+)")
EVAL_LINE = re.compile(r"\[eval\] step (\d+)\s+(.*)")


def parse_progress(text: str) -> tuple[list[tuple[int, float]], list[str]]:
    """(step, mean training loss) pairs and the eval lines from run.py's plain progress output."""
    losses = [(int(m.group(1)), float(m.group(2))) for m in TRAIN_LINE.finditer(text)]
    evals = [m.group(0) for m in EVAL_LINE.finditer(text)]
    return losses, evals


def plot_losses(losses: list[tuple[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in losses], [v for _, v in losses], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over 10 steps)")
    ax.set_title("lra_listops, bf16-mixed, GPU")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def stage_listops(out_dir: Path | None = None) -> Outcome:
    cmd = [
        _python(), "run.py", "recipe=lra_listops", "trainer.precision=bf16-mixed", f"trainer.max_steps={LISTOPS_STEPS}",
        "trainer.accelerator=gpu", "trainer.devices=1", "trainer.progress_bar=false", "trainer.log_every_n_steps=10",
        f"trainer.val_check_interval={LISTOPS_STEPS}", "trainer.limit_val_batches=8", "trainer.limit_test_batches=8",
        "run_root=runs/gpu_check",
    ]  # fmt: skip
    returncode, text = _run(cmd, timeout=LISTOPS_TIMEOUT_S)
    losses, evals = parse_progress(text)
    finite = bool(losses) and all(math.isfinite(v) for _, v in losses)
    first = [v for s, v in losses if s <= 50]
    last = [v for s, v in losses if s > LISTOPS_STEPS - 50]
    learned = bool(first and last) and sum(last) / len(last) < sum(first) / len(first)
    ok = returncode == 0 and finite and learned and losses[-1][0] >= LISTOPS_STEPS
    png = (out_dir or REPORT_DIR) / "gpu_listops_loss.png"
    if losses:
        plot_losses(losses, png)
    body = f"`{' '.join(cmd[1:])}` (exit {returncode})\n\n"
    body += markdown_table(["step", "train loss (mean)"], [[s, f"{v:.4f}"] for s, v in losses]) + "\n\n"
    body += "\n".join(f"    {line}" for line in evals) + "\n"
    if losses:
        body += f"\n![loss curve]({png.name})\n"
    if not ok:
        body += "\nOutput tail:\n\n```\n" + text[-4000:] + "\n```\n"
    return Outcome(ok, body, {"losses": losses})


STAGES: list[tuple[str, float, Callable[[], Outcome]]] = [
    ("cuda_tests", 350, stage_cuda_tests),
    ("model_step", 120, stage_model_step),
    ("listops", 330, stage_listops),
]  # budgets (s) on one H100, enforced (+15 s); measured 402 s with listops beside stages 1-2 (2026-11-24)


# ------------------------------------------------------------------------------------------------ main


def run_parallel(chosen, report: Report, out: Path) -> list[StageResult]:
    """The listops run (a training job: its pass rule is learning, not speed) in a child process beside the
    other stages (tests, the model step): the whole check fits one 10-minute call on a lent machine. The
    child's report section is copied into this report."""
    child_out = out.with_name(out.stem + ".listops.md")
    budget = next(b for n, b, _ in chosen if n == "listops")
    cmd = [_python(), "-m", "bench.gpu_check", "--stages", "listops", "--out", str(child_out)]
    print(f"\n=== listops: started beside the untimed stages ({' '.join(cmd[1:])})", flush=True)
    child = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start = time.perf_counter()
    try:
        results = run_stages([s for s in chosen if s[0] != "listops"], report, summary=False)
        child.wait(timeout=max(1.0, budget + 2 * STAGE_GRACE_S - (time.perf_counter() - start)))
    except subprocess.TimeoutExpired:
        pass
    finally:  # also on Ctrl-C / SIGTERM: no training process is left behind on the GPU
        if child.poll() is None:
            child.kill()
            child.wait()
    text = child_out.read_text() if child_out.exists() else ""
    section = re.search(r"^## listops: (PASS|FAIL) \((\d+) s.*?(?=^## |\Z)", text, re.S | re.M)
    if section:
        child_out.unlink()  # merged: only the one report stays
        body = section.group(0).split("\n", 1)[1]
        result = StageResult("listops", section.group(1) == "PASS", float(section.group(2)), budget, body, {})
    else:
        result = StageResult("listops", False, time.perf_counter() - start, budget, "No report: killed.", {})
    report.add(result)
    results.append(result)
    print(f"=== listops: {'PASS' if result.ok else 'FAIL'} in {result.seconds:.0f} s", flush=True)
    write_summary(report, results)
    return results


def _header() -> str:
    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    commit = os.environ.get("MEGA_COMMIT", "")  # a copy of the tree without .git (a lent machine) names it
    if not commit:
        try:
            git = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            )
            commit = git.stdout.strip()
        except OSError:  # no git on the machine
            pass
    return (
        "# GPU check (`make gpu-check`, bench/gpu_check.py)\n\n"
        f"Device: **{torch.cuda.get_device_name(0)}** ({props.total_memory / 2**30:.0f} GiB, "
        f"sm_{props.major}{props.minor}); torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"Triton {triton.__version__}; commit {commit or '?'}; "
        f"{datetime.datetime.now().isoformat(timespec='minutes')}.\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the Markdown report")
    ap.add_argument("--stages", default=None, help=f"comma list, any of {', '.join(n for n, _, _ in STAGES)}")
    ap.add_argument(
        "--serial",
        action="store_true",
        help="run listops after the other stages, not beside the untimed ones",
    )
    args = ap.parse_args(argv)
    if not has_nvidia_driver():
        print(NO_CUDA, file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    chosen = STAGES
    if args.stages:
        names = args.stages.split(",")
        unknown = [n for n in names if n not in {s[0] for s in STAGES}]
        if unknown:
            ap.error(f"unknown stage(s) {unknown}; expected any of {[s[0] for s in STAGES]}")
        chosen = [s for s in STAGES if s[0] in names]
    global REPORT_DIR
    REPORT_DIR = args.out.parent
    report = Report(args.out, _header())
    names = [s[0] for s in chosen]
    if args.serial or "listops" not in names or len(names) == 1:
        results = run_stages(chosen, report)
    else:
        results = run_parallel(chosen, report, args.out)
    failed = [r.name for r in results if not r.ok]
    print(
        f"\n{args.out}: {len(results) - len(failed)}/{len(results)} stages passed"
        + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
