"""Long-context perplexity (the paper's figure 5): validation perplexity as a function of context length.

For a context length W every document is cut into windows of W tokens, each scored from a fresh streaming
cache, fed in segments of one attention chunk, so memory stays O(C) whatever W is. Every W scores the same
tokens (all but each document's first), so word-level perplexity exp(NLL / words) is comparable across W.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm


def documents_from_segments(loader: Iterable[dict], words: list[int] | None = None) -> Iterator[Tensor]:
    """Re-assemble whole documents [T] from a streaming eval loader ({"input", "target", "first_segment"}).

    With ``words`` (a list) and segments that carry ``"words"`` (the words each segment completes), each
    yielded document's word count is appended to it, so a subset of the documents has its own count.
    """
    parts: list[Tensor] = []
    count = 0
    for batch in loader:
        if bool(batch["first_segment"].any()) and parts:
            if words is not None:
                words.append(count)
            yield torch.cat(parts)
            parts, count = [], 0
        if not parts:
            parts.append(batch["input"][0, :1])
        target = batch["target"][0]
        parts.append(target[target != -100])
        count += int(batch["words"].sum()) if "words" in batch else 0
    if parts:
        if words is not None:
            words.append(count)
        yield torch.cat(parts)


def default_context_lengths(longest: int, start: int = 4096) -> list[int]:
    lengths, w = [], start
    while w < longest:
        lengths.append(w)
        w *= 2
    return lengths + [longest]


@torch.no_grad()
def score_window(model, tokens: Tensor, segment: int) -> tuple[float, int]:
    """Total NLL of tokens[1:] given their prefix in ``tokens`` [T], streamed ``segment`` tokens at a time."""
    cache = None
    nll, count = 0.0, 0
    inputs, targets = tokens[:-1], tokens[1:]
    for start in range(0, inputs.shape[0], segment):
        x = inputs[start : start + segment].unsqueeze(0)
        y = targets[start : start + segment].unsqueeze(0)
        hidden, cache = model.forward_hidden(x, cache, use_cache=True)
        nll += float(model.token_nll(hidden, y).sum())
        count += y.numel()
    return nll, count


@torch.no_grad()
def eval_context(
    model,
    documents: list[Tensor],
    context_lengths: list[int],
    num_words: int | None = None,
    segment: int | None = None,
    progress: bool = True,
) -> list[dict]:
    """Rows {context, tokens, nll, token_ppl, word_ppl, seconds} for each context length."""
    model.eval()
    segment = segment or model.eval_segment()
    device = next(model.parameters()).device
    rows = []
    total_tokens = sum(max(0, d.numel() - 1) for d in documents)
    for w in context_lengths:
        t0 = time.perf_counter()
        nll, count = 0.0, 0
        bar = tqdm(total=total_tokens, desc=f"context {w}", unit="tok", disable=not progress, leave=False)
        for doc in documents:
            doc = doc.to(device)
            # Windows of w inputs; consecutive windows share one boundary token (its last target, next first input).
            for start in range(0, max(1, doc.numel() - 1), w):
                window = doc[start : start + w + 1]
                if window.numel() < 2:
                    continue
                n, c = score_window(model, window, segment)
                nll, count = nll + n, count + c
                bar.update(c)
        bar.close()
        row = dict(context=w, tokens=count, nll=nll, token_ppl=math.exp(min(nll / max(1, count), 50.0)))
        if num_words:
            row["word_ppl"] = math.exp(min(nll / num_words, 50.0))
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(
            f"[eval_context] context {w:>9d}: token ppl {row['token_ppl']:.3f}"
            + (f", word ppl {row['word_ppl']:.3f}" if num_words else "")
            + f" ({row['seconds']:.1f} s)"
        )
    return rows


def write_report(rows: list[dict], out_dir: Path, writer=None, note: str = "") -> tuple[Path, Path]:
    """Markdown table + PNG plot (figure 5 style) in ``out_dir``; scalars to a TensorBoard writer if given.
    ``note`` (how the model sees context beyond its training length) heads the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    key = "word_ppl" if rows and "word_ppl" in rows[0] else "token_ppl"
    lines = [note, ""] if note else []
    lines += ["| context | tokens scored | token ppl | word ppl | seconds |", "|---:|---:|---:|---:|---:|"]
    for r in rows:
        word = f"{r['word_ppl']:.3f}" if "word_ppl" in r else "-"
        lines.append(
            f"| {r['context']} | {r['tokens']} | {r['token_ppl']:.3f} | {word} | {r['seconds']:.1f} |"
        )
    table = out_dir / "eval_context.md"
    table.write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r["context"] for r in rows], [r[key] for r in rows], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("word perplexity" if key == "word_ppl" else "token perplexity")
    ax.set_title("Validation perplexity vs context length")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    plot = out_dir / "eval_context.png"
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    if writer is not None:
        for r in rows:
            writer.add_scalar(f"eval_context/{key}", r[key], r["context"])
        writer.add_text("eval_context", "\n".join(lines))
        writer.flush()
    return table, plot
