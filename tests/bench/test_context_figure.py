"""bench.context_figure: several mode=eval_context runs (written like write_report's) in one table and plot."""

from __future__ import annotations

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from bench.context_figure import main
from mega_suite.evaluation.context import write_report


def eval_run(root: Path, name: str, ppl: dict[int, float], note: str) -> Path:
    run = root / name / "kjv" / "t0"
    writer = SummaryWriter(str(run))
    rows = [dict(context=c, tokens=10, nll=1.0, token_ppl=p, seconds=0.0) for c, p in ppl.items()]
    write_report(rows, run, writer, note=note)
    writer.close()
    return run


def test_table_lists_each_model_per_context_and_marks_the_window(tmp_path, capsys):
    mega = eval_run(tmp_path, "m", {512: 30.0, 4096: 25.0}, "Model: megalodon, streaming")
    llama = eval_run(
        tmp_path, "l", {512: 28.0, 4096: 27.5}, "Model: llama, sliding (window 1024, stride 512)"
    )
    assert main([str(mega), str(llama), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "ppl_vs_context.md").read_text()
    assert "| context | megalodon | llama |" in text
    assert "| 512 | 30.000 | 28.000 |" in text and "| 4096 | 25.000 | 27.500 |" in text
    assert "- Model: llama, sliding (window 1024, stride 512)" in text
    assert (tmp_path / "out" / "ppl_vs_context.png").read_bytes()[:4] == b"\x89PNG"
    assert main([str(tmp_path / "m"), "--out", str(tmp_path)]) == 2  # not a run directory
    assert "no TensorBoard event files" in capsys.readouterr().err
