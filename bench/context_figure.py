"""Perplexity against context length for several ``mode=eval_context`` runs on one plot and in one table.

``python -m bench.context_figure RUN_DIR RUN_DIR ... --out DIR`` reads each run's ``eval_context/*_ppl``
TensorBoard scalars (step = context length, written by :func:`mega_suite.evaluation.context.write_report`) and the
first line of its ``eval_context.md`` (the model and how it sees context beyond its training window), and
writes ``DIR/ppl_vs_context.md`` and ``DIR/ppl_vs_context.png`` (the paper's figure 5 for several models;
a second panel shows each curve relative to its shortest context, where small changes are visible). A run whose model has a fixed window (Llama: ``window W``) gets a dotted vertical line at ``W``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from mega_suite.evaluation.compare import CompareError, read_scalars

PPL_TAGS = ("eval_context/word_ppl", "eval_context/token_ppl")


def load(path: Path) -> tuple[str, str, dict[int, float], str]:
    """(label, perplexity kind, {context: perplexity}, note) of one eval_context run directory."""
    curves, _ = read_scalars(path)
    tag = next((t for t in PPL_TAGS if t in curves), None)
    if tag is None:
        raise CompareError(f"{path}: no {' or '.join(PPL_TAGS)} scalars; is it a mode=eval_context run?")
    report = path / "eval_context.md"
    note = report.read_text().splitlines()[0] if report.is_file() else ""
    model = re.match(r"Model: (\w+)", note)
    label = model.group(1) if model else path.parent.parent.name
    curve = curves[tag]
    return label, tag.split("/")[1], dict(zip(curve.steps.tolist(), curve.values.tolist())), note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.context_figure", description=__doc__.split("\n")[0]
    )
    parser.add_argument("runs", nargs="+", help="mode=eval_context run directories")
    parser.add_argument("--out", required=True, help="folder for ppl_vs_context.md / .png")
    args = parser.parse_args(argv)
    try:
        runs = [load(Path(p)) for p in args.runs]
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kinds = {kind for _, kind, _, _ in runs}
    if len(kinds) > 1:
        print(
            f"error: the runs report different perplexities ({sorted(kinds)}); compare like with like",
            file=sys.stderr,
        )
        return 2
    kind = kinds.pop().replace("_", " ")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    contexts = sorted({c for _, _, rows, _ in runs for c in rows})
    lines = [f"Validation {kind} against context length.", ""]
    lines += [f"- {note}" for _, _, _, note in runs if note]
    lines += ["", "| context | " + " | ".join(label for label, *_ in runs) + " |"]
    lines.append("|---:|" + "---:|" * len(runs))
    for c in contexts:
        cells = [f"{rows[c]:.3f}" if c in rows else "" for _, _, rows, _ in runs]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    (out / "ppl_vs_context.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, rel) = plt.subplots(1, 2, figsize=(11, 4))
    for k, (label, _, rows, note) in enumerate(runs):
        xs = sorted(rows)
        ax.plot(xs, [rows[x] for x in xs], marker="o", color=f"C{k}", label=label)
        rel.plot(xs, [100 * (rows[x] / rows[xs[0]] - 1) for x in xs], marker="o", color=f"C{k}", label=label)
        window = re.search(r"window (\d+)", note)
        if window:
            w = int(window.group(1))
            for a in (ax, rel):
                a.axvline(w, color=f"C{k}", linestyle=":", linewidth=1)
            ax.annotate(
                f"{label} window {w}", (w, 0.5), xycoords=("data", "axes fraction"), fontsize=7,
                color=f"C{k}", ha="right", va="center", rotation=90,
            )  # fmt: skip
    for a in (ax, rel):
        a.set_xscale("log", base=2)
        a.set_xlabel("context length (tokens)")
        a.grid(alpha=0.3)
    ax.set_ylabel(f"validation {kind}")
    ax.set_title("Perplexity vs context length")
    rel.set_ylabel("change from the shortest context (%)")
    rel.set_title("Relative to each model's shortest context")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ppl_vs_context.png", dpi=100)
    plt.close(fig)
    print((out / "ppl_vs_context.md").read_text())
    print(f"wrote {out / 'ppl_vs_context.md'} and {out / 'ppl_vs_context.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
