"""The lm-eval adapter (``SuiteLM``) one request at a time against batched, side by side in one process.

    python -m bench.lm_eval_batch                                   # both archs, batch 16, ~3 min
    python -m bench.lm_eval_batch --arch megalodon --batch 8,32 --limit 50 --synthetic 500

Models: the KJV recipe's (recipes/kjv.yaml: 4 layers, D 256, chunk 256, vocabulary 4096; ``model.arch=llama``
its parameter-matched Llama, window 1024), randomly initialised (timing does not depend on training). Work:

- ``kjv_cloze`` (``loglikelihood``, four choices per verse) and ``kjv_verses`` (``loglikelihood_rolling``),
  the local KJV tasks of corpora/kjv/tasks, their requests built by the harness (``--limit`` documents each);
- a synthetic ``loglikelihood`` task of ``--synthetic`` requests (default 2,000): a context of 8 to 96
  random tokens and a continuation of 1 to 12, the shape of a multiple-choice benchmark (ARC, PIQA).

Each is answered by ``SuiteLM(batch_size=1)`` and by each ``--batch`` size, one thread, the order of the
paths alternating; the table gives seconds, requests per second and the speed-up, and the largest difference
between the two answers (log-probability, and whether every ``is_greedy`` agrees). ``kjv_complete``
(``generate_until``) is not timed: it is answered one request at a time at every batch size.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from bench.common import machine_description, markdown_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "corpora" / "kjv" / "tasks"


def kjv_model(arch: str, seed: int = 0):
    from datamodules.kjv import TOKENIZER
    from datamodules.tokenizer import TextTokenizer
    from mega_suite.config.recipes import load_config
    from mega_suite.config.resolve import model_config
    from mega_suite.models.registry import build_model

    tokenizer = TextTokenizer(TOKENIZER)
    cfg = load_config(["recipe=kjv", f"model.arch={arch}"])
    torch.manual_seed(seed)
    return build_model(model_config(cfg, vocab_size=tokenizer.vocab_size)).eval(), tokenizer


def kjv_requests(limit: int) -> dict[str, list]:
    """The harness's requests of kjv_cloze and kjv_verses (``limit`` documents each), by request type."""
    from lm_eval.tasks import get_task_dict

    from mega_suite.evaluation.harness import load_tasks, task_manager

    names = ["kjv_cloze", "kjv_verses"]
    manager = task_manager(names, str(TASKS))
    tasks = get_task_dict(load_tasks(manager, names), manager)
    out = {}
    for name, task in tasks.items():
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        out[name] = list(task.instances)
    return out


def synthetic_requests(n: int, vocab: int, seed: int = 0) -> list:
    """``_loglikelihood_tokens`` requests: (strings, context tokens, continuation tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        context = [rng.randrange(4, vocab) for _ in range(rng.randint(8, 96))]
        continuation = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 12))]
        out.append((None, context, continuation))
    return out


def answer(lm, kind: str, requests: list) -> list:
    if kind == "synthetic":
        return lm._loglikelihood_tokens(requests, disable_tqdm=True)
    if kind == "loglikelihood":
        return lm.loglikelihood(requests, disable_tqdm=True)
    return lm.loglikelihood_rolling(requests, disable_tqdm=True)


def difference(a: list, b: list) -> tuple[float, bool]:
    if isinstance(a[0], tuple):
        return max(abs(x[0] - y[0]) for x, y in zip(a, b)), all(x[1] == y[1] for x, y in zip(a, b))
    return max(abs(x - y) for x, y in zip(a, b)), True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="megalodon,llama")
    parser.add_argument("--batch", default="16", help="batch sizes to time against 1, comma-separated")
    parser.add_argument("--limit", type=int, default=100, help="documents per KJV task (each has 100)")
    parser.add_argument("--synthetic", type=int, default=2000, help="requests of the synthetic task")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from mega_suite.evaluation.harness import SuiteLM

    batches = [int(b) for b in args.batch.split(",")]
    kjv = kjv_requests(args.limit)
    rows = []
    t_all = time.perf_counter()
    for arch in args.arch.split(","):
        model, tokenizer = kjv_model(arch)
        work = [
            (f"kjv_cloze ({len(kjv['kjv_cloze'])} loglikelihood)", "loglikelihood", kjv["kjv_cloze"]),
            (f"kjv_verses ({len(kjv['kjv_verses'])} rolling)", "rolling", kjv["kjv_verses"]),
            (f"synthetic ({args.synthetic} loglikelihood)", "synthetic",
             synthetic_requests(args.synthetic, tokenizer.vocab_size)),
        ]  # fmt: skip
        lms = {b: SuiteLM(model, tokenizer, batch_size=b) for b in [1, *batches]}
        answer(lms[1], "synthetic", synthetic_requests(8, tokenizer.vocab_size, seed=1))  # warm-up
        for label, kind, requests in work:
            seconds, results = {}, {}
            order = [1, *batches] if len(rows) % 2 == 0 else [*batches, 1]  # alternate who goes first
            for b in order:
                t0 = time.perf_counter()
                results[b] = answer(lms[b], kind, requests)
                seconds[b] = time.perf_counter() - t0
            for b in batches:
                diff, greedy = difference(results[1], results[b])
                rows.append([
                    arch, label, str(b), f"{seconds[1]:.2f}", f"{seconds[b]:.2f}",
                    f"{len(requests) / seconds[1]:.0f}", f"{len(requests) / seconds[b]:.0f}",
                    f"{seconds[1] / seconds[b]:.1f}x", f"{diff:.1e}", "yes" if greedy else "NO",
                ])  # fmt: skip
                print(" | ".join(rows[-1]), flush=True)
    headers = ["arch", "work", "batch", "s (batch 1)", "s (batched)", "req/s (1)", "req/s (batched)",
               "speed-up", "max |Δ log p|", "is_greedy equal"]  # fmt: skip
    print()
    print(f"python -m bench.lm_eval_batch {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(machine_description(args.threads))
    print(markdown_table(headers, rows))
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
