"""What fit leaves for after training, on a JSON-lines corpus with no tokenizer given (an llm_* recipe): the
SentencePiece model trained on the training split only (reproducible, keyed by the corpus's content, also
as a command), copied into the run directory; checkpoints every N steps, the newest K kept; mode=lm_eval
over them gives score against training tokens."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
from modality_fixtures import write_jsonl_corpus

import datamodules.pretrain as pretrain
from datamodules.pretrain import PretrainDataModule, held_out, training_text

TASKS = Path(__file__).resolve().parents[1] / "evaluation" / "tasks"
PLANTED = "zyzzyvaquux"  # a word that only held-out documents contain
SPLIT = dict(val_fraction=0.3, split_seed=0)


def planted_corpus(folder: Path, split: dict = SPLIT) -> list[str]:
    """The fixture corpus plus one file whose documents hold PLANTED where (and only where) they are held out
    under ``split``."""
    docs = write_jsonl_corpus(folder)
    planted, i = [], 0
    while sum(PLANTED in d for d in planted) < 3 or len(planted) < 12:
        text = f"document {i} says {PLANTED} {PLANTED} and more words"
        if held_out(text, **split):
            planted.append(text)
        else:
            planted.append(f"document {i} says nothing strange at all")
        i += 1
    (folder / "planted.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in planted))
    return docs + planted


def test_the_trained_tokenizer_sees_only_training_documents_and_is_reproducible(tmp_path):
    corpus = tmp_path / "corpus"
    docs = planted_corpus(corpus)
    assert any(PLANTED in d for d in docs)
    dm = PretrainDataModule(str(corpus), vocab_size=300, cache_dir=str(tmp_path / "cache1"), **SPLIT)
    lines = list(training_text(dm._files_by_content(), "text", SPLIT["split_seed"], SPLIT["val_fraction"]))
    assert lines and not any(PLANTED in line for line in lines)
    # a control: the same word in a training document does reach the text
    kept = [d for d in docs if not held_out(d, **SPLIT)]
    assert all(any(d.strip() == line for line in lines) for d in kept[:5])
    first = dm.tokenizer_file
    # the same corpus elsewhere, under other file names: the same key and the same bytes
    moved = tmp_path / "elsewhere"
    for i, path in enumerate(sorted(p for p in corpus.rglob("*") if p.is_file())):
        target = moved / f"renamed_{i}{''.join(path.suffixes)}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    again = PretrainDataModule(str(moved), vocab_size=300, cache_dir=str(tmp_path / "cache2"), **SPLIT)
    second = again.tokenizer_file
    assert first.name == second.name and first.parent.name == second.parent.name
    assert first.read_bytes() == second.read_bytes()
    # the command: the same file
    from mega_suite.cli import main

    out = tmp_path / "cmd.model"
    assert main(["tokenizer", str(corpus), "--vocab-size", "300", "--val-fraction", "0.3", "--cache-dir", str(tmp_path / "cache3"),
                 "--out", str(out)]) == 0  # fmt: skip
    assert out.read_bytes() == first.read_bytes()
    # another corpus: another key
    (corpus / "planted.jsonl").write_text(json.dumps({"text": "one more training document"}) + "\n")
    changed = PretrainDataModule(str(corpus), vocab_size=300, cache_dir=str(tmp_path / "cache1"), **SPLIT)
    assert changed.trained_tokenizer_path() != first


def test_fit_copies_the_tokenizer_and_keeps_step_checkpoints_scored_against_tokens(tmp_path, capsys):
    import run

    corpus = tmp_path / "corpus"
    write_jsonl_corpus(corpus)
    tiny = [
        "recipe=llm_200m", f"data.data_dir={corpus}", "data.options.vocab_size=300", "data.options.val_fraction=0.3",
        "data.options.seq_len=32", "data.batch_size=2", "model.preset=megalodon_debug", "model.chunk_size=16",
        "trainer.strategy=auto", "trainer.precision=32-true", "trainer.devices=1", "trainer.accelerator=cpu",
        "trainer.global_batch_tokens=0", "trainer.progress_bar=false", "trainer.limit_val_batches=1",
        "trainer.val_check_interval=100", "optim.warmup_steps=1",
    ]  # fmt: skip
    assert run.main([*tiny, "trainer.max_steps=6", "trainer.save_every_n_steps=2", "trainer.keep_checkpoints=2",
                     f"run_root={tmp_path / 'runs'}"]) == 0  # fmt: skip
    run_dir = next((tmp_path / "runs" / "llm_200m").iterdir())
    trained = PretrainDataModule(str(corpus), vocab_size=300, val_fraction=0.3).tokenizer_file
    assert (run_dir / "tokenizer.model").read_bytes() == trained.read_bytes()
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step*.ckpt"))
    assert steps == ["step0000004.ckpt", "step0000006.ckpt"]  # step 2 dropped: the newest 2 kept

    capsys.readouterr()
    assert run.main([*tiny, "mode=lm_eval", f"lm_eval.checkpoints=[{run_dir}]", f"lm_eval.include_path={TASKS}",
                     "lm_eval.tasks=[tiny_rolling]", f"run_dir={tmp_path / 'eval'}"]) == 0  # fmt: skip
    curve = (tmp_path / "eval" / "lm_eval_curve.md").read_text()
    rows = re.findall(r"\| (step\d+\.ckpt) \| (\d+) \| (\d+) \|", curve)
    assert rows == [("step0000004.ckpt", "4", str(4 * 2 * 32)), ("step0000006.ckpt", "6", str(6 * 2 * 32))]
    assert (tmp_path / "eval" / "lm_eval_curve.png").is_file()
    assert len(json.loads((tmp_path / "eval" / "lm_eval.json").read_text())) == 2


# ----------------------------------------------------------------------------------------------------------
# the split's settings and the cache key, varied
# ----------------------------------------------------------------------------------------------------------

SPLITS = [dict(val_fraction=0.3, split_seed=0), dict(val_fraction=0.6, split_seed=0),
          dict(val_fraction=0.3, split_seed=1), dict(val_fraction=0.2, split_seed=7)]  # fmt: skip


def held_out_oracle(text: str, val_fraction: float, split_seed: int) -> bool:
    """datamodules/pretrain.py's definition: BLAKE2b-64(text as UTF-8, key = str(split_seed)), read as a
    little-endian integer, over 2^64 < val_fraction."""
    digest = hashlib.blake2b(text.encode(), digest_size=8, key=str(split_seed).encode()).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def test_held_out_is_its_definition_for_every_setting():
    texts = [f"document {i} with words" for i in range(400)]
    sets = []
    for split in SPLITS:
        held = [held_out(t, **split) for t in texts]
        assert held == [held_out_oracle(t, **split) for t in texts], split
        assert abs(sum(held) / len(texts) - split["val_fraction"]) < 5 * (0.25 / len(texts)) ** 0.5, split
        sets.append(frozenset(t for t, h in zip(texts, held) if h))
    assert len(set(sets)) == len(SPLITS)  # each setting holds out its own documents


@pytest.fixture
def recorded_training(monkeypatch) -> dict[Path, list[str]]:
    """SentencePiece replaced by a recorder: what each tokenizer would be trained on, by its path (and a
    stand-in file there, so the cache finds it)."""
    seen: dict[Path, list[str]] = {}

    def record(lines, path, **options):
        seen[Path(path)] = list(lines)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(b"stand-in")

    monkeypatch.setattr(pretrain, "train_sentencepiece", record)
    return seen


def test_each_split_setting_keeps_its_own_held_out_documents_from_the_tokenizer(
    tmp_path, recorded_training, capsys
):
    """For each (val_fraction, split_seed), on a corpus whose planted word lies in exactly the documents that
    setting holds out: the tokenizer (through the data module and the command) is trained on exactly the other
    documents, never the planted word. The seed and the fraction swapped anywhere on the way fail this."""
    from mega_suite.cli import main

    cache = tmp_path / "cache"
    for n, split in enumerate(SPLITS):
        corpus = tmp_path / f"corpus{n}"
        docs = planted_corpus(corpus, split)
        assert any(PLANTED in d for d in docs)
        dm = PretrainDataModule(str(corpus), vocab_size=300, cache_dir=str(cache), **split)
        path = dm.tokenizer_file
        lines = recorded_training[path]
        assert not any(PLANTED in line for line in lines), split
        assert sorted(lines) == sorted(d.strip() for d in docs if not held_out_oracle(d, **split)), split
        capsys.readouterr()
        assert main(["tokenizer", str(corpus), "--vocab-size", "300", "--val-fraction", str(split["val_fraction"]),
                     "--split-seed", str(split["split_seed"]), "--cache-dir", str(cache)]) == 0  # fmt: skip
        assert capsys.readouterr().out.strip() == str(path)  # the command's key: the same cached file
    assert len(recorded_training) == len(SPLITS)


def test_the_cache_key_names_the_split_settings(tmp_path):
    """One corpus: each (val_fraction, split_seed) its own tokenizer key, the same one again for the same
    setting."""
    corpus = tmp_path / "corpus"
    write_jsonl_corpus(corpus)

    def key(**split):
        return PretrainDataModule(
            str(corpus), vocab_size=300, cache_dir=str(tmp_path / "c"), **split
        ).trained_tokenizer_path()

    keys = [key(**split) for split in SPLITS]
    assert len(set(keys)) == len(SPLITS) and len({k.parent for k in keys}) == len(SPLITS)
    assert [key(**split) for split in SPLITS] == keys
