"""``mode=passkey``: long-context retrieval, the passkey test (a needle in a haystack; Mohtashami & Jaggi,
2023) at prompt lengths 1K ... 64K tokens (docs/after_training.md#passkey).

Each prompt is ``BOS`` + haystack with the needle ``The pass key is 12345. Remember it. 12345 is the pass
key.`` at a depth between 10% and 90% of the haystack + ``What is the pass key? The pass key is``; the model
continues it greedily for a few tokens and is right when the first number it writes is the key. The haystack
is the classic filler (``The grass is green. The sky is blue. ...``, repeated) or any text
(``passkey.haystack=PATH``: a file, or a folder of ``.txt`` files, e.g. held-out books).

What each architecture sees: Megalodon streams the whole prompt (its state carries the needle however far
back); Llama sees its window, so its prompt keeps the last ``max_seq_len - new tokens`` tokens and the needle is
in view only when it lies among them. Each row reports both.

``python -m mega_suite.evaluation.passkey RUN_DIR RUN_DIR ... --out DIR``: the runs' tables side by side and
a figure of accuracy against prompt length.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from mega_suite.models.generation import generate

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
DEFAULT_LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
NEW_TOKENS = 8  # enough for a 5-digit key in any of the suite's tokenizers


def haystack(tok, source: str) -> list[int]:
    """Token ids of the haystack: the filler, or the text of a file / a folder's ``.txt`` files."""
    if source == "filler":
        return tok.encode(" ".join([FILLER] * 64), bos=False)
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"passkey.haystack={source}: no .txt files in that folder")
        text = "\n".join(f.read_text() for f in files)
    elif path.is_file():
        text = path.read_text()
    else:
        raise FileNotFoundError(
            f"passkey.haystack={source}: expected 'filler', a text file or a folder of .txt files"
        )
    return tok.encode(" ".join(text.split()), bos=False)


def make_prompt(
    tok, hay: list[int], length: int, depth: float, key: str, offset: int
) -> tuple[list[int], int]:
    """A prompt of ``length`` tokens with the needle at ``depth`` of the haystack; (ids, needle start)."""
    needle = tok.encode(" " + NEEDLE.format(key=key), bos=False)
    question = tok.encode(" " + QUESTION, bos=False)
    fill = length - 1 - len(needle) - len(question)
    if fill < 1:
        raise ValueError(f"passkey length {length} is shorter than the needle and question")
    reps = -(-(offset + fill) // len(hay))
    tokens = (hay * reps)[offset : offset + fill]
    at = int(round(depth * fill))
    ids = [tok.bos_id, *tokens[:at], *needle, *tokens[at:], *question]
    return ids, 1 + at


# a number: a run of digits and its decimal part; a point not followed by a digit is a full stop
FIRST_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def score(answer: str, key: str) -> tuple[bool, float]:
    """(right, share of digits right): right when the first number ``answer`` writes is ``key``
    (docs/after_training.md#passkey); the share compares that number with the key position by position."""
    found = FIRST_NUMBER.search(answer)
    guess = found.group(0) if found else ""
    return guess == key, sum(a == b for a, b in zip(guess, key)) / len(key)


def visible(model, prompt: list[int]) -> int:
    """How many of the prompt's last tokens the model sees when it answers."""
    window = getattr(model.cfg, "max_seq_len", None)
    return len(prompt) if window is None else min(len(prompt), window - NEW_TOKENS)


@torch.no_grad()
def evaluate(model, tok, lengths: list[int], samples: int, hay: list[int], seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    device = next(model.parameters()).device
    rows = []
    for length in lengths:
        start = time.perf_counter()
        right, digits, in_view, seen = 0, 0.0, 0, 0
        for i in range(samples):
            depth = 0.5 if samples == 1 else 0.1 + 0.8 * i / (samples - 1)
            key = str(int(rng.integers(10000, 100000)))
            ids, at = make_prompt(tok, hay, length, depth, key, int(rng.integers(0, len(hay))))
            seen = visible(model, ids)
            prompt = torch.tensor([ids[len(ids) - seen :]], device=device)
            in_view += at >= len(ids) - seen
            out = generate(model, prompt, NEW_TOKENS, greedy=True, eos_id=tok.eos_id)
            ok, share = score(tok.decode(out[0, prompt.shape[1] :].tolist()), key)
            right += ok
            digits += share
        rows.append(dict(
            length=length, context_seen=seen, needle_in_view=in_view / samples, accuracy=right / samples,
            digits=digits / samples, samples=samples, seconds=time.perf_counter() - start,
        ))  # fmt: skip
        r = rows[-1]
        print(
            f"[passkey] {length:>6d} tokens: accuracy {r['accuracy']:.2f} (digits {r['digits']:.2f}), context seen "
            f"{seen}, needle in view {r['needle_in_view']:.0%} ({r['seconds']:.1f} s)"
        )
    return rows


def table(rows: list[dict], note: str) -> str:
    lines = [note, "", "| prompt tokens | context seen | needle in view | accuracy | digits right | seconds |",
             "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['length']} | {r['context_seen']} | {r['needle_in_view']:.0%} | {r['accuracy']:.2f} | "
            f"{r['digits']:.2f} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def run_passkey(cfg: DictConfig, trained: Any, run_dir: Path) -> dict[str, float]:
    """mode=passkey: rows for each of ``passkey.lengths`` into ``passkey.json`` / ``passkey.md`` / ``passkey.png``
    and TensorBoard."""
    from torch.utils.tensorboard import SummaryWriter

    p = cfg.passkey
    lengths = list(p.lengths) or DEFAULT_LENGTHS
    hay = haystack(trained.tokenizer, p.haystack)
    note = (
        f"Passkey retrieval, {p.samples} prompts per length, haystack {p.haystack}. Model: {trained.context_note()}. "
        f"Checkpoint: {trained.source}"
    )
    print(f"[mega-suite] {note}")
    rows = evaluate(trained.model, trained.tokenizer, lengths, int(p.samples), hay, int(cfg.seed))
    record = {"arch": trained.arch, "checkpoint": str(trained.source), "note": note, "rows": rows}
    (run_dir / "passkey.json").write_text(json.dumps(record, indent=1) + "\n")
    (run_dir / "passkey.md").write_text(table(rows, note))
    figure([record], run_dir / "passkey.png")
    writer = SummaryWriter(str(run_dir))
    for r in rows:
        writer.add_scalar("passkey/accuracy", r["accuracy"], r["length"])
        writer.add_scalar("passkey/context_seen", r["context_seen"], r["length"])
    writer.close()
    print(table(rows, note))
    return {f"passkey@{r['length']}": r["accuracy"] for r in rows}


def figure(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for rec in records:
        rows = rec["rows"]
        ax.plot(
            [r["length"] for r in rows],
            [r["accuracy"] for r in rows],
            marker="o",
            label=f"{rec['arch']} accuracy",
        )
        ax.plot([r["length"] for r in rows], [r["needle_in_view"] for r in rows], ls=":", marker=".",
                label=f"{rec['arch']}: needle in view")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("fraction of prompts")
    ax.set_title("Passkey retrieval")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def side_by_side(records: list[dict]) -> str:
    """One table of several runs: per length, each architecture's accuracy and the context it saw."""
    lengths = sorted({r["length"] for rec in records for r in rec["rows"]})
    head = "| prompt tokens | " + " | ".join(
        f"{rec['arch']} accuracy | {rec['arch']} context seen" for rec in records
    )
    lines = [head + " |", "|---:|" + "---:|---:|" * len(records)]
    for n in lengths:
        cells = []
        for rec in records:
            row = next((r for r in rec["rows"] if r["length"] == n), None)
            cells += [f"{row['accuracy']:.2f}", str(row["context_seen"])] if row else ["-", "-"]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + [f"- {rec['note']}" for rec in records]) + "\n"


def combine(runs: list[str], out: str, overwrite: bool = False) -> str:
    """``mega-suite passkey``: several mode=passkey folders' tables side by side and one figure."""
    from mega_suite.errors import UserError
    from mega_suite.storage.atomic import new_files

    records = []
    for run in runs:
        file = Path(run) / "passkey.json"
        if not file.is_file():
            raise UserError(f"{run}: no passkey.json (a mode=passkey folder was expected)")
        records.append(json.loads(file.read_text()))
    with new_files(Path(out), ["passkey.md", "passkey.png"], overwrite=overwrite) as tmp:
        (tmp / "passkey.md").write_text(side_by_side(records))
        figure(records, tmp / "passkey.png")
    text = (Path(out) / "passkey.md").read_text()
    return f"{text}\nwrote {Path(out) / 'passkey.md'} and {Path(out) / 'passkey.png'}"


if __name__ == "__main__":  # the older name of `mega-suite passkey`
    from mega_suite.cli import main

    sys.exit(main(["passkey", *sys.argv[1:]], prog="python -m mega_suite.evaluation.passkey"))
