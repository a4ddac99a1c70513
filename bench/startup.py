"""How long a command takes to say something (issue 38): listing the recipes, ``--help``, configuration
errors, a missing checkpoint, an unknown lm-eval task, against Python's own start-up, median of ``--repeat``
runs each, for this checkout and optionally another (``--baseline PATH``, e.g. a ``git worktree`` of an older
commit), side by side in one run.

    python -m bench.startup [--baseline /path/to/older/checkout] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands(bundle: Path) -> list[tuple[str, list[str]]]:
    """(label, arguments after ``python``): every command runs from the checkout under test."""
    return [
        ("python -c pass (Python's own start-up)", ["-c", "pass"]),
        ("run.py (list the recipes)", ["run.py"]),
        ("run.py --help", ["run.py", "--help"]),
        ("a misspelt key", ["run.py", "recipe=kjv", "trainer.max_stps=3"]),
        ("a bad value", ["run.py", "recipe=kjv", "optim.lr=-1"]),
        ("an unknown recipe", ["run.py", "recipe=kvj"]),
        ("a missing checkpoint", ["run.py", "recipe=kjv", "mode=generate", "ckpt=/nonexistent.ckpt", "prompt=x"]),
        ("an unknown lm-eval task (index cached)", [
            "run.py", "recipe=kjv", "mode=lm_eval", f"ckpt={bundle}", "lm_eval.tasks=[hellaswagg]",
            "trainer.accelerator=cpu"]),
        ("the tools' --help", ["-m", "mega_suite.training.checkpoint", "--help"]),
    ]  # fmt: skip


def seconds(repo: Path, args: list[str], repeat: int, env: dict) -> tuple[float, int]:
    times, code = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, timeout=600)
        times.append(time.perf_counter() - start)
        code = proc.returncode
    return statistics.median(times), code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default=None, help="another checkout, timed beside this one")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    from after_fixtures import tiny_bundle  # tests/support: a debug-size bundle over the KJV tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        bundle = tiny_bundle("megalodon", Path(tmp) / "bundle")
        env = dict(os.environ, HF_HUB_OFFLINE="1", MEGA_MALLOC="system", PYTHONDONTWRITEBYTECODE="")
        repos = [("this checkout", ROOT)] + ([("baseline", Path(a.baseline))] if a.baseline else [])
        for _, repo in repos:  # warm the page cache and the lm-eval task index once
            seconds(repo, commands(bundle)[-2][1], 1, dict(env, PYTHONPATH=str(repo)))
        rows = []
        for label, args in commands(bundle):
            row = [label]
            for _, repo in repos:
                value, code = seconds(repo, args, a.repeat, dict(env, PYTHONPATH=str(repo)))
                row.append(f"{value:.2f} (exit {code})")
            rows.append(row)
    header = "| command | " + " | ".join(f"{name} s" for name, _ in repos) + " |"
    print(header)
    print("|---|" + "---:|" * len(repos))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nmedian of {a.repeat} runs each; {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d')}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    sys.exit(main())
