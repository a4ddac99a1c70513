"""``mega-suite``: the tools beside ``run.py`` (docs/after_training.md), one console script as litgpt has one.

    mega-suite export RUN|CKPT|BUNDLE OUT [--dtype bf16] [--max-shard-size 5GB] [--overwrite]
    mega-suite consolidate RUN|CKPT OUT.pt [--overwrite]
    mega-suite compare RUN RUN ... [--out DIR] [--group-by-seed] [--smooth W] [--overwrite]
    mega-suite passkey RUN RUN ... [--out DIR] [--overwrite]
    mega-suite tokenizer DATA_DIR [--vocab-size N] [--out PATH] [--overwrite]

Every tool checks what it reads and where it writes before writing anything, writes its result whole (a
temporary name renamed into place) and never replaces an existing file or folder without ``--overwrite``; a
mistake is one ``error:`` line and exit code 2. ``python -m mega_suite`` and ``python -m
mega_suite.training.checkpoint`` are the same command line. Arguments are parsed before torch is imported.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) while a command works: its temporary files are removed on the way out."""


@contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """SIGTERM raises ``Interrupted`` (as SIGINT raises KeyboardInterrupt), so that ``finally`` blocks remove
    partial files instead of the process dying where it stands."""

    def stop(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every other refusal
        print(f"error: {message} ({self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def parser(prog: str = "mega-suite") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    e = sub.add_parser("export", help="a trained model -> a safetensors bundle transformers loads")
    e.add_argument("source", help="run folder (its newest checkpoint), checkpoint, sharded folder or bundle")
    e.add_argument("out", help="new folder: model.safetensors, config.json, the tokenizer")
    e.add_argument(
        "--dtype", default=None, help="parameters' dtype in the files: bf16, fp16, fp32 (default: as saved)"
    )
    e.add_argument(
        "--max-shard-size", default="5GB", help="split model.safetensors above this size (default 5GB)"
    )
    e.add_argument("--overwrite", action="store_true", help="replace OUT if it is a bundle")
    c = sub.add_parser("consolidate", help="a (sharded) checkpoint -> one reference-format .pt file")
    c.add_argument("source", help="run folder (its newest checkpoint) or checkpoint")
    c.add_argument("out", help="new .pt file")
    c.add_argument("--overwrite", action="store_true", help="replace OUT if it is a torch file")
    m = sub.add_parser("compare", help="runs side by side: compare.md and compare.png")
    m.add_argument("runs", nargs="+", help="run folders (runs/<recipe>/<time>/)")
    m.add_argument("--out", default=".", help="folder for compare.md and compare.png (default: .)")
    m.add_argument("--group-by-seed", action="store_true", help="mean and min/max band over seeds")
    m.add_argument("--smooth", type=float, default=0.0, help="EMA weight for the training curves (0..1)")
    m.add_argument("--overwrite", action="store_true", help="replace the report files if they exist")
    k = sub.add_parser("passkey", help="mode=passkey folders side by side: passkey.md and passkey.png")
    k.add_argument("runs", nargs="+", help="mode=passkey folders")
    k.add_argument("--out", default=".", help="folder for passkey.md and passkey.png (default: .)")
    k.add_argument("--overwrite", action="store_true", help="replace the report files if they exist")
    t = sub.add_parser(
        "tokenizer", help="train (or find cached) the SentencePiece model of a JSON-lines corpus"
    )
    t.add_argument("data_dir", help="the corpus folder (data.data_dir of the llm_* recipes)")
    t.add_argument("--vocab-size", type=int, default=32000)
    t.add_argument("--model-type", default="unigram", choices=("unigram", "bpe", "char", "word"))
    t.add_argument("--patterns", nargs="+", default=["**/*.jsonl", "**/*.jsonl.gz"])
    t.add_argument("--text-field", default="text")
    t.add_argument("--val-fraction", type=float, default=0.001, help="as data.options.val_fraction")
    t.add_argument("--split-seed", type=int, default=0, help="as data.options.split_seed")
    t.add_argument("--input-sentence-size", type=int, default=5_000_000, help="lines sampled to train on")
    t.add_argument("--cache-dir", default=None, help="default <data_dir>/cache/pretrain")
    t.add_argument("--out", default=None, help="also copy the model to this new file")
    t.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return p


def _run(args) -> str:
    """The command's work; returns what to print."""
    if args.command == "export":
        from mega_suite.training.export import export

        out = export(args.source, args.out, args.dtype, args.max_shard_size, args.overwrite)
        return f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}"
    if args.command == "consolidate":
        from mega_suite.training.export import consolidate

        out = consolidate(args.source, args.out, args.overwrite)
        return f"wrote {out}"
    if args.command == "compare":
        from mega_suite.evaluation.compare import run_compare

        return run_compare(args.runs, args.out, args.group_by_seed, args.smooth, args.overwrite)
    if args.command == "passkey":
        from mega_suite.evaluation.passkey import combine

        return combine(args.runs, args.out, args.overwrite)
    from mega_suite.tools.tokenizer import tokenizer_command

    return tokenizer_command(args)


def main(argv: list[str] | None = None, prog: str = "mega-suite") -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parser(prog).parse_args(argv)
    from datamodules.errors import DataError
    from mega_suite.errors import UserError

    try:
        with signals_as_exceptions():
            print(_run(args))
    except (UserError, DataError, FileNotFoundError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as exc:
        reason = "SIGINT" if isinstance(exc, KeyboardInterrupt) else str(exc)
        print(f"error: stopped by {reason}; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
