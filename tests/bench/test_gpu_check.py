"""bench/gpu_check.py (``make gpu-check``) as far as a CPU allows: the no-CUDA exit, the stage runner and
its report, the stage table, the progress parsing, and the Makefile target."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(gpu_check.has_nvidia_driver(), reason="an NVIDIA driver is present")
def test_exits_nonzero_at_once_without_cuda_and_before_importing_torch():
    code = "import sys; from bench import gpu_check; rc = gpu_check.main([]); print('torch' in sys.modules); sys.exit(rc)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip() == gpu_check.NO_CUDA
    assert "CUDA" in proc.stderr and proc.stdout.strip() == "False"  # torch never imported


@pytest.mark.skipif(gpu_check.has_nvidia_driver(), reason="an NVIDIA driver is present")
def test_module_entry_point_exits_nonzero_without_cuda():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr


def test_runner_writes_each_stage_as_it_ends_and_keeps_going_after_a_crash(tmp_path):
    out = tmp_path / "GPU_RESULTS.md"
    report = gpu_check.Report(out, "# GPU check\n\nDevice: **fake**\n")
    seen_before_second = {}

    def first():
        return gpu_check.Outcome(True, "| a | b |\n|---|---|\n| 1 | 2 |", {"x": 1.5})

    def crashing():
        seen_before_second["text"] = out.read_text()
        raise RuntimeError("kernel exploded")

    def failing():
        return gpu_check.Outcome(False, "ratio 1.7")

    results = gpu_check.run_stages(
        [("first", 10, first), ("crash", 20, crashing), ("slow", 30, failing)], report
    )
    assert [(r.name, r.ok) for r in results] == [("first", True), ("crash", False), ("slow", False)]
    assert results[0].numbers == {"x": 1.5}
    assert "## first: PASS" in seen_before_second["text"]  # written before the next stage started
    text = out.read_text()
    assert text.startswith("# GPU check") and "Device: **fake**" in text
    assert "## crash: FAIL" in text and "RuntimeError: kernel exploded" in text
    assert "## slow: FAIL" in text and "ratio 1.7" in text
    assert re.search(r"\| first \| PASS \| \d+ \| 10 \|", text)
    assert "## Summary" in text


def test_a_stage_past_its_budget_fails_alone(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(gpu_check, "STAGE_GRACE_S", 0)
    report = gpu_check.Report(tmp_path / "r.md", "# GPU check\n")
    start = time.perf_counter()
    results = gpu_check.run_stages(
        [("hang", 1, lambda: time.sleep(30)), ("next", 5, lambda: gpu_check.Outcome(True))], report
    )
    assert time.perf_counter() - start < 10
    assert [(r.name, r.ok) for r in results] == [("hang", False), ("next", True)]
    assert "StageTimeout" in (tmp_path / "r.md").read_text()


def test_a_killed_command_returns_what_it_printed():
    rc, text = gpu_check._run(
        [sys.executable, "-c", "import time; print('step 1', flush=True); time.sleep(30)"], 2
    )
    assert rc == 124 and "step 1" in text and "killed after 2 s" in text


def test_a_failing_cuda_test_shows_its_error_above_the_output_tail(monkeypatch):
    """The lease of 2026-11-24 (evening) wrote 5,000 characters of torch's DEBUG trace lines as the output
    tail of a failing GPU test, and its error was cut to "Run...". The exception lines now come first, and
    pytest no longer prints a failure's captured logs."""
    args_seen = []
    failing = (
        "F.\n___ test_reduce_overhead ___\n"
        "E       RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture\n"
        + "DEBUG    torch.__trace:utils.py:2126 \n" * 400
        + "FAILED tests/training/test_compile.py::test_reduce_overhead - Run...\n1 failed, 7 passed in 69.10s\n"
    )

    def fake_pytest(args, timeout):
        args_seen.append(args)
        return (1, failing) if args[0] == "-m" else (0, "89 passed in 121.95s\n")

    monkeypatch.setattr(gpu_check, "_pytest", fake_pytest)
    outcome = gpu_check.stage_cuda_tests()
    assert not outcome.ok
    errors = outcome.body.split("Errors:")[1].split("Output tail:")[0]
    assert "Cannot copy between CPU and CUDA tensors during CUDA graph capture" in errors
    assert len(args_seen) == 2


def test_the_gpu_tests_run_without_printing_captured_logs(monkeypatch):
    seen = []
    monkeypatch.setattr(gpu_check, "_run", lambda cmd, timeout: seen.append(cmd) or (0, ""))
    gpu_check._pytest(["-m", "gpu", "tests"], timeout=1)
    assert "--show-capture=no" in seen[0]


def test_listops_runs_beside_the_other_stages_and_its_section_is_merged(tmp_path, monkeypatch):
    """The child process's report section lands in the parent's report after the other stages'."""
    fake = tmp_path / "fake_python"
    # argv: -m bench.gpu_check --stages listops --out FILE
    fake.write_text(
        '#!/bin/sh\nsleep 1\nprintf "# child\\n\\n## listops: PASS (7 s, budget 330 s)\\n\\nloss fell\\n" > "$6"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setattr(gpu_check, "_python", lambda: str(fake))
    order = []

    def stage(name):
        return lambda: order.append(name) or gpu_check.Outcome(True, name)

    chosen = [(n, 30, stage(n)) for n in ("cuda_tests", "model_step")] + [("listops", 30, None)]
    out = tmp_path / "r.md"
    results = gpu_check.run_parallel(chosen, gpu_check.Report(out, "# GPU check\n"), out)
    assert [r.name for r in results] == ["cuda_tests", "model_step", "listops"]
    assert order == ["cuda_tests", "model_step"] and all(r.ok for r in results)
    text = out.read_text()
    assert "## listops: PASS (7 s" in text and "loss fell" in text and "## Summary" in text
    assert not (tmp_path / "r.listops.md").exists()  # merged, then removed


def test_every_stage_exists_and_the_budget_fits_twenty_minutes():
    """Correctness only: the speed stages are ``make gpu-bench``'s (bench/gpu_bench.py), whose report the
    check no longer overwrites."""
    names = [name for name, _, _ in gpu_check.STAGES]
    assert names == ["cuda_tests", "model_step", "listops"]
    for name, budget, fn in gpu_check.STAGES:
        assert fn is getattr(gpu_check, f"stage_{name}") and callable(fn) and budget > 0
    assert sum(budget for _, budget, _ in gpu_check.STAGES) <= 20 * 60
    assert gpu_check.DEFAULT_OUT == ROOT / "bench" / "GPU_CHECK.md"
    for path in gpu_check.CUDA_TEST_FILES:
        assert (ROOT / path).exists(), path


def test_model_step_cases_build_with_valid_configs():
    for task in ("lm", "classifier"):
        model, inputs, loss_fn = gpu_check._model_case(task)
        assert inputs[0].shape == (2, 4096) and callable(loss_fn)
        assert model.cfg.chunk_size == 1024 and model.cfg.num_layers == 2
    assert model.cfg.is_classifier
    # The float64 truth run keeps float64 through the loss (a .float() on the logits once rounded it).
    tokens, padding = (t[:, :256] for t in inputs)
    assert loss_fn(model.double(), tokens, padding).dtype == torch.float64


def test_progress_lines_are_parsed_and_plotted(tmp_path):
    text = (
        "[train] step 25/500  loss(mean) 2.301  train/loss 2.29  lr 1e-05  0.12 s/step  ETA 1m\n"
        "noise\n"
        "[train] step 50/500  loss(mean) 2.1  train/acc 0.2  lr 2e-05  0.11 s/step  ETA 1m\n"
        "[eval] step 500  val/acc 0.25  val/loss 2.0\n"
    )
    losses, evals = gpu_check.parse_progress(text)
    assert losses == [(25, 2.301), (50, 2.1)]
    assert evals == ["[eval] step 500  val/acc 0.25  val/loss 2.0"]
    png = tmp_path / "loss.png"
    gpu_check.plot_losses(losses, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_makefile_target_runs_the_module():
    text = (ROOT / "Makefile").read_text()
    rule = re.search(r"^gpu-check:(.*)\n\t(.*)$", text, re.MULTILINE)
    assert rule, "no gpu-check target"
    assert "-m bench.gpu_check" in rule.group(2)
    assert re.search(r"^\.PHONY:.*\bgpu-check\b", text, re.MULTILINE)


@pytest.mark.slow
def test_decode_gpu_bench_runs_its_gemv_comparison_on_the_cpu(tmp_path, monkeypatch):
    """``python -m bench.decode_gpu --gemv ...`` (the next GPU lease's A/B of the one-row GEMVs) runs end to
    end on the CPU, where every variant is torch.mv: its table has the eager path and one row per variant
    (here with bf16 keys and values, ``--kv-dtype``), each compiled with Inductor's defaults and again with
    ``--compile-options`` (which reach ``StaticDecoder``)."""
    from bench import decode_gpu
    from mega_suite.models.megalodon import decode

    built = []

    class Recorded(decode.StaticDecoder):
        def __init__(self, *args, **kwargs):
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(decode, "StaticDecoder", Recorded)
    torch._dynamo.reset()
    out = tmp_path / "decode.md"
    try:
        rc = decode_gpu.main(["--device", "cpu", "--preset", "megalodon_debug", "--gemv", "mv,triton", "--tokens",
                              "2", "--prompt", "8", "--kv-dtype", "bfloat16", "--out", str(out),
                              "--compile-options", '{"realize_opcount_threshold": 1}'])  # fmt: skip
    finally:
        torch._dynamo.reset()
    assert rc == 0
    assert "cached keys and values bfloat16" in out.read_text()
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "ms/token" not in line]
    opts = ', options {"realize_opcount_threshold": 1}'
    assert [r.split("|")[1].strip() for r in rows] == [
        "eager (block_step)", "compiled step, GEMV mv", f"compiled step, GEMV mv{opts}",
        "compiled step, GEMV triton", f"compiled step, GEMV triton{opts}",
    ]  # fmt: skip
    assert [(kw["row_gemv"], kw.get("compile_options")) for kw in built if kw.get("compile")] == [
        ("mv", {}), ("mv", {"realize_opcount_threshold": 1}), ("triton", {}),
        ("triton", {"realize_opcount_threshold": 1}),
    ]  # fmt: skip
    for bad in ("{", "[1]", "{}"):
        with pytest.raises(SystemExit):
            decode_gpu.main(["--device", "cpu", "--gemv", "mv", "--compile-options", bad])
    with pytest.raises(SystemExit):
        decode_gpu.main(["--device", "cpu", "--compile-options", '{"a": 1}'])


def test_head_precision_bench_runs_on_the_cpu(tmp_path):
    """``python -m bench.diagnostics.head_precision`` (the next GPU lease's measure of the float32 logits head) runs on
    the CPU, where TF32 does not apply: one row per head computation, the float32 one as trained first."""
    from bench.diagnostics import head_precision

    out = tmp_path / "head.md"
    rc = head_precision.main(["--device", "cpu", "--preset", "megalodon_debug", "--tokens", "64", "--repeat",
                              "2", "--out", str(out)])  # fmt: skip
    assert rc == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "TFLOP/s" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["float32", "bf16 matmul"]
    assert "megalodon_debug: D 32, V" in text


def test_head_precision_bench_refuses_cuda_without_a_device():
    from bench.diagnostics import head_precision

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit) as exc:
        head_precision.main(["--tokens", "8"])
    assert exc.value.code == 2
