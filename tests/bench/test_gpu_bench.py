"""bench/gpu_bench.py (``make gpu-bench``) as far as a CPU allows: the no-CUDA exit, the roofline-only table,
the command line, the stage runner with its deadline and its report, the warm-up children, the Makefile target,
and every timed stage end to end on CPU tensors at tiny sizes (the references and the Triton interpreter), the
suite's own training step included."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench import gpu_bench
from bench import roofline as rl
from bench.gpu_check import Outcome, has_nvidia_driver

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def state(monkeypatch):
    """A fresh shared state for the test (the module's is process-wide)."""
    fresh = gpu_bench.Bench()
    monkeypatch.setattr(gpu_bench, "STATE", fresh)
    return fresh


@pytest.mark.skipif(has_nvidia_driver(), reason="an NVIDIA driver is present")
def test_exits_2_with_one_clear_error_before_importing_torch():
    code = "import sys; from bench import gpu_bench; rc = gpu_bench.main([]); print('torch' in sys.modules); sys.exit(rc)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == gpu_bench.NO_CUDA
    assert proc.stdout.strip() == "False"  # torch never imported
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_bench"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and "--roofline-only" in proc.stderr


def test_roofline_only_prints_the_spec_sheet_table_without_torch():
    code = "import sys; from bench import gpu_bench; rc = gpu_bench.main(['--roofline-only']); print('torch' in sys.modules); sys.exit(rc)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.strip().endswith("False")
    assert out.startswith("Ceilings: H100 SXM5 spec sheet (not measured)")
    for name in (
        "TimestepNorm B1 L32768 D4096 G64 bf16",
        "CEMA B1 L32768 D4096 N16 fp32",
        "Megalodon block B1 L32768",
    ):
        assert f"| {name} |" in out


def test_command_line():
    args = gpu_bench.parse_args(
        [
            "--stages",
            "kernels, attention",
            "--deadline",
            "120",
            "--autotune",
            "--no-warm",
            "--train-args",
            "a=1 b=2",
        ]
    )
    assert args.stages == ["kernels", "attention"] and args.deadline == 120 and args.autotune and args.no_warm
    assert args.train_args == "a=1 b=2"
    args = gpu_bench.parse_args([])
    assert (
        args.stages is None
        and args.deadline == gpu_bench.DEFAULT_DEADLINE_S
        and args.out == gpu_bench.DEFAULT_OUT
    )
    assert args.out == ROOT / "bench" / "GPU_RESULTS.md"
    for bad in (["--stages", "kernels,nope"], ["--stages", ","], ["--deadline", "0"], ["--warm", "nope"]):
        with pytest.raises(SystemExit) as exc:
            gpu_bench.parse_args(bad)
        assert exc.value.code == 2


def test_the_stages_fit_five_minutes():
    names = [name for name, _, _ in gpu_bench.STAGES]
    assert names == [
        "warm",
        "ceilings",
        "kernels",
        "attention",
        "block_eager",
        "block_variants",
        "train_step",
        "block_compiled",
        "block_reduce_overhead",
        "block_compiled_long",
    ]
    for name, budget, fn in gpu_bench.STAGES:
        assert fn is getattr(gpu_bench, f"stage_{name}") and budget > 0
    assert gpu_bench.DEFAULT_DEADLINE_S <= 300 - 15  # a run ends inside 5 minutes, exit and report included
    assert gpu_bench.CUDAGRAPH_MODES == __import__("mega_suite.config", fromlist=["x"]).CUDAGRAPH_MODES
    assert set(gpu_bench.BLOCK_MODES) == {
        "eager",
        *__import__("mega_suite.config", fromlist=["x"]).COMPILE_MODES,
    }


def test_the_runner_writes_each_stage_as_it_ends_and_stops_at_the_deadline(tmp_path, state):
    """Each stage lands in the report before the next starts, with the targets and the roofline above it; a
    crash fails its stage only; stages the deadline leaves no time for are recorded as not run."""
    out = tmp_path / "GPU_RESULTS.md"
    report = gpu_bench.BenchReport(out, "# GPU benchmark\n\nDevice: **fake**\n", state)
    now = [0.0]
    seen = {}

    def first():
        state.target("a target", "0.9", True, "first")
        state.floor_cells(rl.Work("some work", flops=1e12, bytes=1e9), 2.0)
        now[0] += 100
        return Outcome(True, "| a |\n|---|\n| 1 |")

    def crashing():
        seen["after first"] = out.read_text()
        now[0] += 100
        raise RuntimeError("kernel exploded")

    never = []
    stages = [
        ("first", 60, first),
        ("crash", 60, crashing),
        ("late", 60, lambda: never.append(1) or Outcome(True)),
    ]
    results = gpu_bench.run_within(stages, report, deadline_s=220, clock=lambda: now[0], start=0.0)
    assert [(r.name, r.ok) for r in results] == [("first", True), ("crash", False), ("late", False)]
    assert not never
    before = seen["after first"]
    assert "## first: PASS" in before and "## crash" not in before
    assert (
        before.index("## Targets (issues 29 and 37)") < before.index("## Roofline") < before.index("## first")
    )
    assert "| a target | 0.9 | met | first |" in before
    floor_ms = rl.Work("w", flops=1e12, bytes=1e9).floor_s(rl.H100_SXM_SPEC) * 1e3
    assert f"| some work | 2.000 | {floor_ms:.3f} | compute | {2.0 / floor_ms:.2f}x |" in before
    text = out.read_text()
    assert "RuntimeError: kernel exploded" in text
    assert "## late: FAIL" in text and "Not run: the run's deadline (220 s) came first." in text
    assert "## Summary" in text


def test_a_stage_gets_only_the_time_left_before_the_deadline(tmp_path, state, monkeypatch):
    budgets = []
    monkeypatch.setattr(
        gpu_bench, "run_stages", lambda stages, report, results, summary: budgets.append(stages[0][1])
    )
    report = gpu_bench.BenchReport(tmp_path / "r.md", "# h\n", state)
    gpu_bench.run_within(
        [("a", 200, None), ("b", 20, None)], report, deadline_s=100, clock=lambda: 30.0, start=0.0
    )
    grace = __import__("bench.gpu_check", fromlist=["x"]).STAGE_GRACE_S
    assert budgets == [100 - 30 - grace, 20]


def test_the_deadline_counts_from_the_run_not_from_the_process(tmp_path, state, monkeypatch):
    """A process that imported the module long ago (a test worker alive for an hour) still gets the whole
    deadline: the clock starts when ``run_within`` is called, not at import."""
    budgets = []
    monkeypatch.setattr(
        gpu_bench, "run_stages", lambda stages, report, results, summary: budgets.append(stages[0][1])
    )
    report = gpu_bench.BenchReport(tmp_path / "r.md", "# h\n", state)
    an_hour_later = lambda: time.monotonic() + 3600.0  # noqa: E731  (the clock of a long-lived worker)
    results = gpu_bench.run_within([("a", 20, None)], report, deadline_s=600, clock=an_hour_later)
    assert budgets == [20], [r.body for r in results]


def test_warm_children_run_in_parallel_and_a_failure_is_reported(tmp_path, state, monkeypatch):
    fake = tmp_path / "fake_python"
    # argv: -m bench.gpu_bench --warm GROUP
    fake.write_text(
        textwrap.dedent("""\
        #!/bin/sh
        sleep 1
        if [ "$4" = "bad" ]; then echo "boom in $4"; exit 3; fi
        exit 0
        """)
    )
    fake.chmod(0o755)
    monkeypatch.setattr(gpu_bench.sys, "executable", str(fake))
    monkeypatch.setattr(gpu_bench, "WARM_GROUPS", {"good": None, "bad": None, "also_good": None})
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import time

    start = time.perf_counter()
    outcome = gpu_bench.stage_warm()
    assert time.perf_counter() - start < 2.8  # three 1-second children side by side
    assert not outcome.ok
    rows = re.findall(r"^\| (\w+) \| (\w+) \|", outcome.body, re.M)
    assert rows[1:] == [("good", "0"), ("bad", "3"), ("also_good", "0")]
    assert "boom in bad" in outcome.body


def test_the_benchmark_imports_nothing_the_gpu_machine_lacks():
    """The lent machine's python3 has torch and Triton but not omegaconf, soundfile or Lightning's extras:
    the benchmark and the blocks it builds must import without them."""
    code = textwrap.dedent("""\
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('omegaconf', 'soundfile', 'lightning', 'pytorch_lightning', 'sentencepiece', 'tokenizers', 'timm'):
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        from bench import gpu_bench, block
        from mega_suite.models.megalodon.block import MegalodonBlock
        import kernels.attention.probs, kernels.attention.sdpa, kernels.cema, kernels.timestep_norm, kernels.qk_norm_rope, kernels.gemv
        gpu_bench.STATE.sizes.block_preset = 'megalodon_debug'
        print(gpu_bench.block_works(64)['megalodon'].name)
        """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "Megalodon block B1 L64"


def test_the_stage_deadline_ends_the_stage_even_inside_a_timed_call(state):
    """A failing call is a "-" row and the stage goes on; the stage's deadline (SIGALRM's StageTimeout, also
    wrapped as Inductor wraps what interrupts a compile) must end the stage, not become a row."""
    from bench.gpu_check import StageTimeout

    def fails():
        raise RuntimeError("out of memory")

    assert gpu_bench.try_ms(fails) is None

    def interrupted_compile():
        try:
            raise StageTimeout("stage stopped after its budget")
        except StageTimeout as e:
            raise RuntimeError("InductorError: StageTimeout") from e

    for fn in (interrupted_compile, lambda: (_ for _ in ()).throw(StageTimeout("budget"))):
        with pytest.raises(StageTimeout):
            gpu_bench.try_ms(fn)


def test_block_step_rejects_unknown_modes_and_kinds():
    with pytest.raises(ValueError, match="block mode must be one of"):
        gpu_bench.block_step("megalodon", 64, "turbo")
    with pytest.raises(ValueError, match="block kind must be"):
        gpu_bench.block_step("mamba", 64)


TINY = gpu_bench.Sizes(
    kernel_length=64, dim=32, groups=4, ndim=4, heads=2, z_dim=16, ffn_dim=64, chunk=32,
    attention=((1, 2, 64, 32, 16, 16), (1, 2, 64, 32, 16, 64)), block_lengths=(64, 128),
    block_preset="megalodon_debug", llama=dict(dim=32, heads=4, ffn_dim=64), copy_bytes=1 << 20, gemm_n=64,
    low_dtype="float16",
    train_overrides=("model.preset=megalodon_debug", "model.num_layers=1", "data.options.vocab_size=64"),
    train_lengths=(64,), train_steps=(1, 2),
)  # fmt: skip


def test_every_timed_stage_runs_end_to_end_on_the_cpu(tmp_path, state, monkeypatch):
    """Ceilings, kernels, attention, the eager blocks and the suite's training step on CPU tensors at tiny sizes
    (the PyTorch references; the attention paths in the Triton interpreter, float16): every row is filled,
    every target recorded."""
    monkeypatch.setattr(state, "device", "cpu")
    monkeypatch.setattr(state, "sizes", TINY)
    out = tmp_path / "GPU_RESULTS.md"
    report = gpu_bench.BenchReport(out, "# GPU benchmark\n", state)
    stages = ("ceilings", "kernels", "attention", "block_eager", "block_variants", "train_step")
    chosen = [s for s in gpu_bench.STAGES if s[0] in stages]
    results = gpu_bench.run_within(chosen, report, deadline_s=600)
    text = out.read_text()
    assert [r.ok for r in results] == [True] * 6, text[-3000:]
    assert state.ceilings is not None and state.ceilings.source == "measured in this process"
    assert "Ceilings: measured in this process" in text
    section = text[text.index("## kernels: PASS") : text.index("## attention: PASS")]
    kernel_rows = re.findall(r"^\| (TimestepNorm|CEMA|Q/K norm|GEMV)[^|]*\|([^|]*)\|", section, re.M)
    assert len(kernel_rows) == 6 + len(gpu_bench.QK_VARIANTS)
    assert all(ms.strip() not in ("", "-") for _, ms in kernel_rows)
    attention_paths = re.findall(r"^\| dk16 dv(\d+) \| ([^|]+) \| ([^|]+) \|", text, re.M)
    assert {p.strip() for _, p, _ in attention_paths} >= {"probs", "probs, saved P", "fused", "sdpa"}
    assert all(ms.strip() != "-" for _, p, ms in attention_paths if p.strip() != "SDPA flash")
    assert "the dispatcher picks `sdpa`" in text and "the dispatcher picks `fused`" in text  # dv 64 <= 256
    blocks = re.findall(r"^\| (64|128) \| (megalodon|llama) \| eager \| ([^|]+) \|", text, re.M)
    assert len(blocks) == 4 and all(ms.strip() != "-" for *_, ms in blocks)
    section = text[text.index("## block_variants: PASS") : text.index("## train_step: PASS")]
    variants = re.findall(r"^\| (64|128) \| ([^|]+?) \| ([^|]+) \| ([^|]+) \|", section, re.M)
    assert [v for _, v, *_ in variants] == [n for n, _ in gpu_bench.BLOCK_VARIANTS] * 2, variants
    assert all(ms.strip() != "-" for *_, ms, _ in variants)
    targets = [row[0] for row in state.targets]
    assert any(t.startswith("TimestepNorm fwd+bwd >= 60%") for t in targets)
    assert sum(t.startswith("CEMA fwd+bwd <= 2.5 ms") for t in targets) == 2  # the default and tensor cores
    assert any("attention dv 64" in t for t in targets) and any("attention dv 16" in t for t in targets)
    assert sum(t.startswith("Megalodon / Llama eager") for t in targets) == 2
    assert sum(t.startswith("Q/K norm + RoPE fwd+bwd >= 70%") for t in targets) == len(gpu_bench.QK_VARIANTS)
    # the whole model through the suite's training step: both models, every column, the ratios beside the block's
    section = text[text.index("## train_step: PASS") :]
    trained = re.findall(r"^\| 64 \| (megalodon|llama), 1 layer \|(.*)\|$", section, re.M)
    assert [m for m, _ in trained] == ["megalodon", "llama"], section[:3000]
    for _, cells in trained:
        cells = [c.strip() for c in cells.split("|")]
        assert len(cells) == len(gpu_bench.TRAIN_HEADERS) - 2
        assert all(c != "-" for i, c in enumerate(cells) if gpu_bench.TRAIN_HEADERS[i + 2] != "peak GiB")
    assert re.search(r"^- L 64: Megalodon / Llama \d+\.\d\d through the training step; \d+\.\d\d for one eager "
                     r"block .*; \d+\.\d\d for the two models' own layers$", section, re.M)  # fmt: skip
    assert "`recipe=llm_7b`" in section and "`model.num_layers=1`" in section
    train = {row[0]: row[2] for row in state.targets if row[3] == "train_step"}
    assert set(train) == {
        "Megalodon MFU through the training step at L 64 (reported)",
        "Megalodon / Llama through the training step within 5% of the eager block's at L 64",
    }
    assert all(v in ("met", "missed", "-") for v in train.values())
    assert len(state.roofline) == len(kernel_rows) + len(attention_paths) + 4
    names = [row[0] for row in state.roofline]
    assert len(set(names)) == len(names)  # each figure its own line in the roofline table


def test_makefile_target_runs_without_the_project_environment():
    text = (ROOT / "Makefile").read_text()
    for target, module in (("gpu-bench", "bench.gpu_bench"), ("gpu-check", "bench.gpu_check")):
        rule = re.search(rf"^{target}:(.*)\n\t(.*)$", text, re.MULTILINE)
        assert rule, f"no {target} target"
        assert ".venv/.synced" not in rule.group(1)  # no uv sync on a lent machine
        assert rule.group(2).startswith("$(GPU_PY) -m " + module)
        assert re.search(rf"^\.PHONY:.*\b{target}\b", text, re.MULTILINE)
    assert "echo python3" in re.search(r"^GPU_PY \?= (.*)$", text, re.MULTILINE).group(1)


def test_train_step_runs_the_recipe_with_the_command_lines_overrides_last(state):
    """The runs are the recipe, then the stage's own settings, then ``--train-args``: what a user passes wins."""
    state.train_args = ("trainer.float32_matmul_precision=high", "model.num_layers=4")
    argv = gpu_bench.train_argv("llama", 4096, Path("/tmp/r"))
    assert argv[0] == "recipe=llm_7b" and argv[-2:] == list(state.train_args)
    for key in ("model.arch=llama", "data.options.seq_len=4096", "trainer.max_steps=6", "run_root=/tmp/r",
                "trainer.global_batch_tokens=0", "trainer.devices=1", "trainer.limit_val_batches=0"):  # fmt: skip
        assert key in argv
    assert argv.index("model.num_layers=2") < argv.index("model.num_layers=4")


def test_train_step_without_omegaconf_fails_alone_saying_what_is_missing(state, monkeypatch):
    monkeypatch.setattr(gpu_bench, "TRAIN_NEEDS", ("lightning", "no_such_module_for_the_test"))
    outcome = gpu_bench.stage_train_step()
    assert not outcome.ok
    assert outcome.body.startswith("Not run: the suite's training step needs no_such_module_for_the_test,")


def test_train_step_keeps_the_runs_that_finished_when_its_budget_ends(state, monkeypatch):
    """A failing run is a row of dashes and the next one goes on; the stage's deadline inside a run ends the
    stage with the finished runs, their ratio and a line saying so; the float32 matmul precision the runs set
    is put back."""
    from bench.gpu_check import StageTimeout

    state.sizes = TINY
    state.block_ms = {("eager", 64, "megalodon"): 3.0, ("eager", 64, "llama"): 2.0}
    calls = []

    def fake(arch, length, folder):
        calls.append((arch, length))
        torch.set_float32_matmul_precision("medium")  # as build_trainer does for a run asking for it
        if len(calls) == 3:
            raise RuntimeError("CUDA out of memory")
        if len(calls) == 4:
            raise StageTimeout("stage stopped after its budget")
        return dict(step_ms=20.0 if arch == "megalodon" else 10.0, tokens_per_s=3200.0, flops_per_token=1e6,
                    peak_gib=1.5, params=16000, layers=1, layer_ms=4.0, seconds=1.0)  # fmt: skip

    import torch

    before = torch.get_float32_matmul_precision()
    monkeypatch.setattr(gpu_bench, "train_run", fake)
    monkeypatch.setattr(state.sizes, "train_lengths", (64, 128))
    outcome = gpu_bench.stage_train_step()
    assert torch.get_float32_matmul_precision() == before
    assert not outcome.ok and outcome.body.rstrip().endswith("the runs above finished.")
    assert calls == [("megalodon", 64), ("llama", 64), ("megalodon", 128), ("llama", 128)]
    assert "| 64 | megalodon, 1 layer | 16.0K | 20.0 | 3,200 |" in outcome.body
    assert (
        "| 64 | llama, 1 layer | 16.0K | 10.0 |" in outcome.body
        and "| 4.000 | 4.000 | 6.000 | 1 |" in outcome.body
    )
    assert "| 128 | megalodon | - |" in outcome.body and "| 128 | llama" not in outcome.body
    assert (
        "- L 64: Megalodon / Llama 2.00 through the training step; 1.50 for one eager block" in outcome.body
    )
    verdicts = {row[0]: (row[1], row[2]) for row in state.targets}
    assert verdicts["Megalodon / Llama through the training step within 5% of the eager block's at L 64"] == (
        "2.00 (block 1.50)",
        "missed",
    )
