"""Long-context perplexity (the paper's figure 5): validation perplexity as a function of context length.

For a context length W every document is cut into windows of W tokens, each scored from a fresh streaming
cache, fed in segments of one attention chunk, so memory stays O(C) whatever W is. Every W scores the same
tokens (all but each document's first), so word-level perplexity exp(NLL / words) is comparable across W.

With chunk parallelism (``trainer.chunk_parallel=P``, docs/architecture.md#chunk-parallelism) each window is instead split across P ranks
in chunk-aligned slices (``slice_bounds(..., even=False)``: ceil(W/P) rounded up to C, the last shorter),
every rank runs its slice at once with the TimestepNorm / CEMA states exchanged per layer
(``mega_suite.distributed.chunk_parallel``), and the NLL sums of the ranks add up to the streaming pass's: memory and
time per rank O(W/P). A window too short to give every rank a slice is streamed by rank 0 alone.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from mega_suite.distributed.chunk_parallel import ChunkParallelContext, slice_bounds


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
def score_window_split(model, tokens: Tensor, cp, segment: int) -> tuple[float, int]:
    """This rank's share of the total NLL of tokens[1:] given their prefix in ``tokens`` [T] (the same on
    every rank of ``cp``, a ChunkParallelContext): its chunk-aligned slice of the inputs, run with the state
    exchange. Summed over the ranks: ``score_window``'s NLL and count."""

    inputs, targets = tokens[:-1], tokens[1:]
    try:
        bounds = slice_bounds(inputs.shape[0], cp.world, model.cfg.chunk_size, even=False)
    except ValueError:  # too short for every rank to get a slice; the same decision on every rank
        return score_window(model, tokens, segment) if cp.rank == 0 else (0.0, 0)
    start, stop = bounds[cp.rank]
    with cp.with_lengths([b - a for a, b in bounds]).attached(model):
        hidden, _ = model.forward_hidden(inputs[start:stop].unsqueeze(0))
    y = targets[start:stop].unsqueeze(0)
    return float(model.token_nll(hidden, y).sum()), y.numel()


@torch.no_grad()
def eval_context(
    model,
    documents: list[Tensor],
    context_lengths: list[int],
    num_words: int | None = None,
    segment: int | None = None,
    progress: bool = True,
    cp=None,
) -> list[dict]:
    """Rows {context, tokens, nll, token_ppl, word_ppl, seconds} for each context length.

    ``cp`` (a ChunkParallelContext; every rank of its group calls this with the same documents): each
    window split across the group (``score_window_split``), totals summed over it; rank 0 prints."""
    import torch.distributed as dist

    model.eval()
    segment = segment or model.eval_segment()
    device = next(model.parameters()).device
    rows = []
    total_tokens = sum(max(0, d.numel() - 1) for d in documents)
    speak = cp is None or cp.rank == 0
    for w in context_lengths:
        t0 = time.perf_counter()
        nll, count = 0.0, 0
        bar = tqdm(
            total=total_tokens, desc=f"context {w}", unit="tok", disable=not (progress and speak), leave=False
        )
        for doc in documents:
            doc = doc.to(device)
            # Windows of w inputs; consecutive windows share one boundary token (its last target, next first input).
            for start in range(0, max(1, doc.numel() - 1), w):
                window = doc[start : start + w + 1]
                if window.numel() < 2:
                    continue
                if cp is None:
                    n, c = score_window(model, window, segment)
                else:
                    n, c = score_window_split(model, window, cp, segment)
                nll, count = nll + n, count + c
                bar.update(window.numel() - 1)
        bar.close()
        if cp is not None:
            total = torch.tensor([nll, float(count)], dtype=torch.float64, device=device)
            dist.all_reduce(total, group=cp.group)
            nll, count = float(total[0]), int(total[1])
        row = dict(context=w, tokens=count, nll=nll, token_ppl=math.exp(min(nll / max(1, count), 50.0)))
        if num_words:
            row["word_ppl"] = math.exp(min(nll / num_words, 50.0))
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        if speak:
            print(
                f"[eval_context] context {w:>9d}: token ppl {row['token_ppl']:.3f}"
                + (f", word ppl {row['word_ppl']:.3f}" if num_words else "")
                + (f" ({cp.world} chunk-parallel ranks)" if cp is not None else "")
                + f" ({row['seconds']:.1f} s)"
            )
    return rows


def eval_context_chunk_parallel(
    model,
    documents: list[Tensor],
    context_lengths: list[int],
    world: int,
    mode: str = "parallel",
    device_type: str = "cpu",
    **kwargs,
) -> list[dict]:
    """``eval_context`` over ``world`` chunk-parallel processes spawned here (gloo on CPU, NCCL with one GPU
    per rank on CUDA), every rank holding the whole model: one window of W tokens needs O(W/P) memory per
    rank. Returns rank 0's rows (the group's totals)."""
    import torch.multiprocessing as mp

    if world < 2:
        return eval_context(model, documents, context_lengths, **kwargs)
    if device_type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(
            f"trainer.chunk_parallel={world} needs {world} GPUs for eval_context, {torch.cuda.device_count()} "
            "visible"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        args = (world, port, model.cpu(), documents, context_lengths, mode, device_type, kwargs, out)
        mp.spawn(_chunk_parallel_worker, args=args, nprocs=world, join=True)
        return torch.load(out, weights_only=True)


def _chunk_parallel_worker(
    rank, world, port, model, documents, context_lengths, mode, device_type, kwargs, out
) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        cp = ChunkParallelContext.from_group(None, mode=mode)
        rows = eval_context(model.to(device), documents, context_lengths, cp=cp, **kwargs)
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()
    # gloo's background threads can abort the interpreter's teardown (SIGABRT) after a successful run,
    # which mp.spawn would report as a failure: leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
