"""``mega-suite tokenizer DATA_DIR [--vocab-size N] [--out PATH]``: the SentencePiece model an ``llm_*`` recipe
trains when no tokenizer is given, trained (or found in its cache) for a JSON-lines corpus ahead of a run
(docs/after_training.md#a-tokenizer-for-your-corpus).

The same step as ``PretrainDataModule.tokenizer_file``: the training split's documents only (the held-out
ones, chosen by content hash, never reach it), one file per corpus content and options, byte for byte
reproducible; ``--out`` copies it to a new file (an existing one only with ``--overwrite``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def tokenizer_command(a) -> str:
    """The ``tokenizer`` command of ``mega-suite`` (``mega_suite.cli``): its parsed arguments -> what to print."""
    from datamodules.pretrain import PretrainDataModule
    from mega_suite.errors import UserError
    from mega_suite.storage.atomic import new_output

    if a.vocab_size < 8:
        raise UserError(f"--vocab-size {a.vocab_size}: expected at least 8 pieces")
    if not 0 < a.val_fraction < 1:
        raise UserError(f"--val-fraction {a.val_fraction}: expected a fraction in (0, 1)")
    if a.input_sentence_size < 1:
        raise UserError(f"--input-sentence-size {a.input_sentence_size}: expected at least 1")
    if not Path(a.data_dir).expanduser().is_dir():
        raise UserError(f"DATA_DIR={a.data_dir}: no such folder (a folder of JSON-lines files)")
    if a.out is not None:  # checked before the (long) training
        out = Path(a.out).expanduser()
        if out.is_dir():
            raise UserError(
                f"--out {out} is a folder; give the new file's path (e.g. {out / 'tokenizer.model'})"
            )
        if out.exists() and not a.overwrite:
            raise UserError(f"--out {out} exists; nothing is overwritten without --overwrite")
    dm = PretrainDataModule(
        str(Path(a.data_dir).expanduser()), tokenizer_path=None, patterns=a.patterns, text_field=a.text_field,
        val_fraction=a.val_fraction, split_seed=a.split_seed, cache_dir=a.cache_dir, vocab_size=a.vocab_size,
        spm_model_type=a.model_type, spm_input_sentence_size=a.input_sentence_size,
    )  # fmt: skip
    path = dm.tokenizer_file
    if a.out is None:
        return str(path)
    with new_output(out, "--out", folder=False, overwrite=a.overwrite) as tmp:
        shutil.copyfile(path, tmp)
    return f"wrote {out} (cached as {path})"


if __name__ == "__main__":  # the older name of `mega-suite tokenizer`
    from mega_suite.cli import main

    sys.exit(main(["tokenizer", *sys.argv[1:]], prog="python -m mega_suite.tools.tokenizer"))
