"""``python -m mega_suite.tools.tokenizer DATA_DIR [--vocab-size N] [--out PATH]``: the SentencePiece model an
``llm_*`` recipe trains when no tokenizer is given, trained (or found in its cache) for a JSON-lines corpus
ahead of a run (docs/after_training.md#a-tokenizer-for-your-corpus).

The same step as ``PretrainDataModule.tokenizer_file``: the training split's documents only (the held-out
ones, chosen by content hash, never reach it), one file per corpus content and options, byte for byte
reproducible; ``--out`` copies it elsewhere.
"""

from __future__ import annotations

import argparse
import shutil
import sys


def main(argv: list[str] | None = None) -> int:
    from datamodules import DataError
    from datamodules.pretrain import PretrainDataModule

    p = argparse.ArgumentParser(
        prog="python -m mega_suite.tools.tokenizer", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("data_dir", help="the corpus folder (data.data_dir of the llm_* recipes)")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", default="unigram", help="SentencePiece model type: unigram | bpe | ...")
    p.add_argument("--patterns", nargs="+", default=["**/*.jsonl", "**/*.jsonl.gz"])
    p.add_argument("--text-field", default="text")
    p.add_argument("--val-fraction", type=float, default=0.001, help="as data.options.val_fraction")
    p.add_argument("--split-seed", type=int, default=0, help="as data.options.split_seed")
    p.add_argument("--input-sentence-size", type=int, default=5_000_000, help="lines sampled to train on")
    p.add_argument("--cache-dir", default=None, help="default <data_dir>/cache/pretrain")
    p.add_argument("--out", default=None, help="also copy the model here")
    a = p.parse_args(argv)
    try:
        dm = PretrainDataModule(
            a.data_dir, tokenizer_path=None, patterns=a.patterns, text_field=a.text_field,
            val_fraction=a.val_fraction, split_seed=a.split_seed, cache_dir=a.cache_dir,
            vocab_size=a.vocab_size, spm_model_type=a.model_type, spm_input_sentence_size=a.input_sentence_size,
        )  # fmt: skip
        path = dm.tokenizer_file
    except (DataError, FileNotFoundError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if a.out:
        shutil.copyfile(path, a.out)
        print(f"wrote {a.out} (cached as {path})")
    else:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
