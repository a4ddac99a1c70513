"""Long-context evaluation memory: ``mode=eval_context`` over a generated book of ~1M tokens on a CPU.

Writes a PG19-layout data set whose validation split is one long generated book, runs
``run.py recipe=pg19_small mode=eval_context`` in this process (fresh model, no checkpoint: the point is
memory and speed, not perplexity) and samples the resident memory every 0.5 s. Memory must not grow with
the context length: the streaming cache is O(chunk size).

    .venv/bin/python -m bench.long_context --words 1000000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as `python bench/long_context.py`: the repository root must come first
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = (
    "the of and to a in that was his he it with is for as had you not be her on at by which have or from this "
    "him but all she they were my are me one their so an said them we who would been will no when there if "
    "more out up into do any your what has man could other than our some very time upon about may its only"
).split()


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_data(root: Path, words: int) -> None:
    rng = np.random.default_rng(0)
    for split, books, n in (("train", 3, 20000), ("validation", 1, words), ("test", 1, 2000)):
        folder = root / "pg19" / split
        folder.mkdir(parents=True)
        for b in range(books):
            text = rng.choice(WORDS, size=n)
            lines = [" ".join(text[i : i + 12]) for i in range(0, n, 12)]
            (folder / f"{split}{b}.txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--words", type=int, default=1_000_000, help="words in the validation book")
    parser.add_argument("--contexts", default="4096,65536,1048576", help="context lengths to evaluate")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 when the machine is shared)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from mega_suite.config import load_config
    from mega_suite.training.runner import run

    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def sampler() -> None:
        t0 = time.perf_counter()
        while not stop.is_set():
            samples.append((time.perf_counter() - t0, rss_mb()))
            time.sleep(0.5)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_data(root, args.words)
        cfg = load_config(
            [
                "recipe=pg19_small",
                "mode=eval_context",
                f"data.data_dir={root}",
                "data.options.vocab_size=1000",
                f"eval_context_lengths=[{args.contexts}]",
                f"run_root={root / 'runs'}",
            ]
        )
        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        t0 = time.perf_counter()
        metrics = run(cfg)
        elapsed = time.perf_counter() - t0
        stop.set()
        thread.join()
        table = (Path(metrics["run_dir"]) / "eval_context.md").read_text()
    rss = np.array([s[1] for s in samples])
    n = len(rss)
    print(table)
    print(f"wall time {elapsed:.0f} s; resident memory (MB) sampled every 0.5 s:")
    for frac in (0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
        print(f"  at {frac:4.0%} of the run: {rss[min(n - 1, int(frac * n) - 1)]:.0f}")
    print(f"  peak {rss.max():.0f}, median {np.median(rss):.0f}")


if __name__ == "__main__":
    main()
