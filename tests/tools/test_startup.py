"""Listing, ``--help`` and configuration errors are answered before torch, Lightning or lm-eval is imported
(issue 38: every command waited 12-20 s before it said anything; bench/startup.py times them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# runs run.py's own entry in a process of its own, then says which heavy packages it had imported
PROBE = """
import runpy, sys
sys.argv = ["run.py", *sys.argv[1:]]
code = 0
try:
    runpy.run_path("run.py", run_name="__main__")
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "lightning", "lm_eval", "transformers") if m in sys.modules)
print("HEAVY", code, ",".join(heavy), file=sys.stderr)
"""


def _run(tmp_path: Path, *args: str) -> tuple[int, list[str], str]:
    env = dict(os.environ, MEGA_MALLOC="system", XDG_CACHE_HOME=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    line = [x for x in proc.stderr.splitlines() if x.startswith("HEAVY ")]
    assert line, proc.stderr[-2000:]
    _, code, heavy = (line[-1].split(" ") + [""])[:3]
    return int(code), [h for h in heavy.split(",") if h], proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "args, code, says",
    [
        ((), 0, "recipes"),
        (("--help",), 0, "recipe="),
        (("recipe=kjv", "trainer.max_stps=3"), 2, "trainer.max_stps"),
        (("recipe=kjv", "optim.lr=-1"), 2, "optim.lr"),
        (("recipe=kvj",), 2, "kvj"),
        (("recipe=kjv", "data.options.seq_len=abc"), 2, "seq_len"),
        (
            ("recipe=kjv", "mode=lm_eval", "ckpt=/nonexistent.ckpt", "lm_eval.tasks=hellaswagg"),
            2,
            "hellaswagg",
        ),
    ],
    ids=["list", "help", "misspelt key", "bad value", "unknown recipe", "typed data option", "unknown task"],
)
def test_answered_without_heavy_imports(tmp_path, args, code, says):
    import importlib.metadata

    # the harness's task index as a previous run cached it (indexing it is what takes seconds)
    cache = tmp_path / "cache" / "mega_suite" / f"lm_eval_tasks-{importlib.metadata.version('lm_eval')}.json"
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps(["hellaswag", "arc_easy"]))
    got, heavy, out = _run(tmp_path, *args)
    assert got == code and says in out, out[-2000:]
    assert heavy == [], f"imported {heavy} before answering: {out[-1000:]}"
    if code == 2:
        assert "Traceback" not in out and "error: " in out, out[-2000:]
