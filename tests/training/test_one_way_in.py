"""Issue 36's probe suite, in-process: every case of ``bench/user_probe.py`` (code planted in every format the
suite reads, checkpoints, the run plan, run folders, the user's files, paths) runs through the command line's
own entries (``run.main``, ``mega_suite.cli.main``) on a fresh copy of a tiny world, and must hold: a refusal
exits 2 with one ``error:`` line naming the cause, no traceback, nothing created and nothing of the user's
changed; an accepted command does what was asked; no planted payload ever runs. ``python -m bench.user_probe``
runs the same cases as real processes of any checkout (the before / after table of the issue)."""

from __future__ import annotations

import importlib.metadata
import json
import shutil

import pytest

import run as entry
from bench.user_probe import CASES, MARKER, _run, build_world, classify, hold_lock, snapshot
from mega_suite.cli import main as tools


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("probe") / "world")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_probe_holds(case, built, tmp_path, capsys, monkeypatch):
    world = tmp_path / "world"
    shutil.copytree(built, world, symlinks=True)
    (world / "world.json").write_text((world / "world.json").read_text().replace(str(built), str(world)))
    monkeypatch.setenv("HOME", str(world / "home"))
    # the harness's task index as an earlier run cached it (indexing it is ~7 s; tests/evaluation indexes it)
    index = (
        world
        / "home"
        / ".cache"
        / "mega_suite"
        / f"lm_eval_tasks-{importlib.metadata.version('lm_eval')}.json"
    )
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(json.dumps(["arc_easy", "hellaswag", "lambada_openai", "piqa"]))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("MEGA_SUITE_RUN", raising=False)
    monkeypatch.chdir(world)
    argv = case.command(world)
    before = snapshot(world)
    holder = hold_lock(_run(world, "debug")) if "another process holds" in case.name else None
    try:
        code = entry.main(argv[1:]) if argv[0] == "run" else tools(argv[1:])
    finally:
        if holder is not None:
            holder.close()
    out, err = capsys.readouterr()
    outcome = classify(case, code, out, err, world, before)
    assert not (world / MARKER).exists()
    assert outcome.startswith("held"), (outcome, code, err[-3000:])


def test_a_sigterm_during_tokenisation_is_one_line_and_leaves_no_partial_file(
    built, tmp_path, capsys, monkeypatch
):
    """A real SIGTERM while KJV is being tokenised (the first run on a fresh data folder): exit 130 with one
    ``error:`` line, no traceback, no partial file anywhere, and no run folder."""
    import os
    import signal

    import sentencepiece

    data = tmp_path / "kjv"
    shutil.copytree(built / "kjv" / "kjv", data / "kjv")  # the unpacked corpus, without its token cache
    real = sentencepiece.SentencePieceProcessor.encode

    def encode(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(sentencepiece.SentencePieceProcessor, "encode", encode)
    from bench.user_probe import KJV

    code = entry.main([*KJV[1:], "recipe=kjv", f"data.data_dir={data}", f"run_root={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 130 and len(lines) == 1 and "SIGTERM" in lines[0] and "Traceback" not in err, err[-2000:]
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name], "a partial file was left"
    assert not (tmp_path / "runs").exists()


def test_a_resume_with_another_tokenizer_is_refused(built, tmp_path, capsys, monkeypatch):
    """Every checkpoint records the sha256 of the run's tokenizer; a resume whose data module's tokenizer
    differs is refused before anything is written (the digest function is made to differ here: a second
    valid SentencePiece model would take seconds to train)."""
    import mega_suite.training.runner as runner
    from bench.user_probe import KJV

    world = tmp_path / "world"
    shutil.copytree(built, world)
    (world / "world.json").write_text((world / "world.json").read_text().replace(str(built), str(world)))
    monkeypatch.setattr(runner, "file_digest", lambda path: "0" * 64)
    run_dir = _run(world, "kjv")
    before = snapshot(world)
    code = entry.main([*KJV[1:], "recipe=kjv", f"data.data_dir={world / 'kjv'}", "resume=auto",
                       f"run_dir={run_dir}", "trainer.max_steps=4"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "another tokenizer" in err and "Traceback" not in err, err[-2000:]
    assert snapshot(world) == before
