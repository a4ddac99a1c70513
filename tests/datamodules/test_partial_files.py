"""Data preparation never loses or half-writes a file (issue 36, points 4 and 5): a generator writes only
where none of its files exists, an interrupted preparation (``KeyboardInterrupt``, or the ``SystemExit`` a
SIGTERM handler raises) leaves no partial file, and the partial files of a killed one are swept at the next
preparation with one line saying so."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from modality_fixtures import train_sentencepiece, write_jsonl_corpus, write_pg19, write_speech_commands

from datamodules import DataError, KJVDataModule, common
from datamodules.common import partial_file, partial_name, sweep_partial_files

REPO = Path(__file__).resolve().parents[2]
INTERRUPTS = (KeyboardInterrupt, SystemExit)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _partial_of(path: Path, pid: int, host: str | None = None) -> Path:
    """``partial_name(path)`` as process ``pid`` (of ``host``, default this one) would have named it."""
    own = partial_name(path).name
    head, own_host = own.rsplit("-", 1)[0].rsplit(".tmp-", 1)
    return path.with_name(f"{head}.tmp-{host or own_host}-{pid}")


def _leftovers(folder: Path) -> list[str]:
    """Anything under ``folder`` that looks like a temporary file, in the suite's old or new naming."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if ".tmp" in p.name)


def _after_n_calls(n: int, exc: type[BaseException], real):
    """``real``, raising ``exc`` from its ``n``-th call on (a signal arriving mid-preparation)."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= n:
            raise exc()
        return real(*args, **kwargs)

    return wrapped


# ------------------------------------------------------------------------------------------ the helper
@pytest.mark.parametrize("exc", [ValueError, *INTERRUPTS])
def test_a_partial_file_is_renamed_when_complete_and_removed_by_anything_else(tmp_path, exc):
    target = tmp_path / "out.bin"
    with pytest.raises(exc), partial_file(target) as tmp:
        tmp.write_bytes(b"half")
        raise exc()
    assert list(tmp_path.iterdir()) == []
    with partial_file(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.read_bytes() == b"whole" and list(tmp_path.iterdir()) == [target]


def test_the_sweep_removes_only_partial_files_whose_writer_is_gone(tmp_path, capsys):
    dead, own = _dead_pid(), os.getpid()
    day = 24 * 3600
    removed = {
        _partial_of(tmp_path / "a.bin", dead): None,  # its process is gone
        _partial_of(tmp_path / "kjv", dead): "dir",  # an unpacking folder
        _partial_of(tmp_path / "c.bin", own): time.time() - day,  # older than this process: pid reused
        _partial_of(tmp_path / "e.bin", 1, "another-host"): time.time() - 2 * day,  # a shared disk, long idle
    }
    kept = {
        _partial_of(tmp_path / "b.bin", own): None,  # this process is writing it
        _partial_of(tmp_path / "d.bin", 1, "another-host"): None,  # may be written on the other host now
        tmp_path / "user.tmp": None,  # not the suite's naming: never touched
        tmp_path / "notes.tmp123": None,
    }
    for path, how in {**removed, **kept}.items():
        if how == "dir":
            (path / "kjv").mkdir(parents=True)
            (path / "kjv" / "1.txt").write_text("Genesis")
        else:
            path.write_bytes(b"x" * 10)
            if how is not None:
                os.utime(path, (how, how))
    capsys.readouterr()
    assert sorted(sweep_partial_files(tmp_path)) == sorted(removed)
    assert sorted(tmp_path.iterdir()) == sorted(kept)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("[mega-suite] removed 4 partial file(s)")
    assert all(p.name in out[0] for p in removed) and str(tmp_path) in out[0]
    assert sweep_partial_files(tmp_path) == [] and capsys.readouterr().out == ""


# ------------------------------------------------------------------------------------ ListOps (point 4)
def test_a_missing_listops_split_is_an_error_and_the_users_splits_are_untouched(tmp_path):
    """One missing split used to regenerate all three over the user's real train and val files."""
    from datamodules.lra import ListOpsDataModule

    folder = tmp_path / "listops-1000"
    folder.mkdir()
    mine = {"basic_train.tsv": "Source\tTarget\n( ( [MAX 2 ) ] )\t2\n", "basic_val.tsv": "Source\tTarget\n"}
    for name, text in mine.items():
        (folder / name).write_text(text)
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()}
    dm = ListOpsDataModule(str(tmp_path), batch_size=2, generate_sizes=(6, 2, 2))
    with pytest.raises(DataError) as info:
        dm.prepare_data()
    message = str(info.value)
    assert "basic_test.tsv" in message and "basic_train.tsv, basic_val.tsv" in message
    assert "\n" not in message and "remov" not in message and "delet" not in message
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["listops-1000"]


def test_the_listops_generator_never_writes_over_a_complete_set(tmp_path):
    from datamodules.listops_generator import generate_listops

    folder = generate_listops(tmp_path, 6, 2, 2, seed=0, progress=False)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    with pytest.raises(DataError, match="already holds basic_train.tsv, basic_val.tsv, basic_test.tsv"):
        generate_listops(tmp_path, 6, 2, 2, seed=1, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


@pytest.mark.parametrize("where", ["drawing", "placing"])
def test_interrupted_listops_generation_leaves_no_file_and_the_next_succeeds(tmp_path, monkeypatch, where):
    """Interrupted while drawing trees or between placing the three splits: the folder holds none of them
    (a set of one or two would be refused as the user's), and the next preparation generates all three."""
    from datamodules import listops_generator as gen
    from datamodules.lra import ListOpsDataModule

    if where == "drawing":
        monkeypatch.setattr(
            gen.ListOpsSampler, "sample", _after_n_calls(5, KeyboardInterrupt, gen.ListOpsSampler.sample)
        )
    else:
        monkeypatch.setattr(gen, "place_new", _after_n_calls(2, KeyboardInterrupt, gen.place_new))
    dm = ListOpsDataModule(str(tmp_path), batch_size=2, generate_sizes=(6, 2, 2))
    with pytest.raises(KeyboardInterrupt):
        dm.prepare_data()
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []
    monkeypatch.undo()
    dm.setup("fit")
    assert [len(dm.datasets[s]) for s in ("train", "val", "test")] == [6, 2, 2]
    assert _leftovers(tmp_path) == []


# ------------------------------------------------------------------ interrupted preparation (point 5)
@pytest.fixture(scope="module")
def pg19_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pg19")
    texts = write_pg19(root)
    model = train_sentencepiece(root / "tok.model", [t for split in texts.values() for t in split.values()])
    return root, model


@pytest.mark.parametrize("exc", INTERRUPTS)
def test_interrupted_pg19_tokenisation_leaves_no_partial_file_and_the_next_run_succeeds(
    pg19_data, tmp_path, monkeypatch, exc
):
    from datamodules import pg19

    data_dir, model = pg19_data
    make = lambda cache: pg19.PG19DataModule(  # noqa: E731
        str(data_dir), batch_size=2, seq_len=32, tokenizer_path=str(model), cache_dir=str(cache)
    )
    monkeypatch.setattr(pg19, "_ENCODE_BATCH", 1)  # several calls per split: the signal lands mid-file
    monkeypatch.setattr(
        spm.SentencePieceProcessor, "encode", _after_n_calls(3, exc, spm.SentencePieceProcessor.encode)
    )
    dm = make(tmp_path / "cache")
    with pytest.raises(exc):
        dm.prepare_data()
    assert _leftovers(tmp_path) == [] and not (dm.token_dir / "meta.json").exists()
    monkeypatch.undo()
    dm = make(tmp_path / "cache")
    dm.setup("fit")
    clean = make(tmp_path / "clean")
    clean.setup("fit")
    for name in ("train.bin", "val.bin", "test.bin", "val.words.npy", "test.offsets.npy"):
        assert (dm.token_dir / name).read_bytes() == (clean.token_dir / name).read_bytes(), name


def test_interrupted_pretrain_tokenisation_leaves_no_partial_shard(tmp_path, monkeypatch):
    from datamodules.pretrain import PretrainDataModule
    from datamodules.text_lm import TokenFileWriter

    documents = write_jsonl_corpus(tmp_path / "data")
    model = train_sentencepiece(tmp_path / "tok.model", documents)
    make = lambda: PretrainDataModule(  # noqa: E731
        str(tmp_path / "data"),
        tokenizer_path=str(model),
        seq_len=16,
        val_fraction=0.2,
        cache_dir=str(tmp_path / "c"),
    )
    monkeypatch.setattr(TokenFileWriter, "write", _after_n_calls(4, SystemExit, TokenFileWriter.write))
    with pytest.raises(SystemExit):
        make().prepare_data()
    assert _leftovers(tmp_path) == []
    monkeypatch.undo()
    dm = make()
    dm.setup("fit")
    assert len(dm.streams["train"]) > 0 and _leftovers(tmp_path) == []


def test_interrupted_speech_decoding_leaves_no_partial_waveforms(tmp_path, monkeypatch):
    """The decoded clips are written to a memory-mapped partial file: an interrupt left it (40 MB at the
    full size) for good."""
    import soundfile

    from datamodules.speech import SpeechCommandsDataModule

    write_speech_commands(tmp_path / "data")
    monkeypatch.setattr(soundfile, "read", _after_n_calls(3, KeyboardInterrupt, soundfile.read))
    dm = SpeechCommandsDataModule(str(tmp_path / "data"), batch_size=4, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(KeyboardInterrupt):
        dm.prepare_data()
    assert _leftovers(tmp_path) == []
    monkeypatch.undo()
    dm.setup("fit")
    assert len(dm.datasets["train"]) > 0 and _leftovers(tmp_path) == []


def test_interrupted_kjv_unpacking_leaves_no_partial_corpus(tmp_path, monkeypatch):
    import tarfile

    from datamodules.kjv import unpack

    real = tarfile.TarFile.extractall

    def extract_then_interrupt(self, path, *args, **kwargs):
        real(self, path, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(tarfile.TarFile, "extractall", extract_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        unpack(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert unpack(tmp_path) == tmp_path / "kjv" and _leftovers(tmp_path) == []


def test_the_next_preparation_sweeps_what_a_killed_one_left(pg19_data, tmp_path, capsys):
    """A SIGKILL runs no ``finally``: the next preparation removes its partial files, in one line."""
    from datamodules.pg19 import PG19DataModule

    data_dir, model = pg19_data
    dm = PG19DataModule(
        str(data_dir), batch_size=2, seq_len=32, tokenizer_path=str(model), cache_dir=str(tmp_path)
    )
    dead = _dead_pid()
    planted = [
        _partial_of(tmp_path / "spm_unigram_300.model", dead),
        _partial_of(dm.token_dir / "train.bin", dead),
    ]
    dm.token_dir.mkdir(parents=True)
    for path in planted:
        path.write_bytes(np.arange(1000, dtype=np.uint16).tobytes())
    capsys.readouterr()
    dm.prepare_data()
    out = capsys.readouterr().out
    assert _leftovers(tmp_path) == []
    lines = [line for line in out.splitlines() if "partial file" in line]
    assert len(lines) == 2 and all(p.name in "".join(lines) for p in planted)


# ------------------------------------------------------------------------- messages (point 4)
def test_a_shipped_folder_is_never_advised_for_removal(capsys):
    """``data.data_dir=corpora`` finds the repository's corpora/kjv (the archive, not the corpus): the error
    said to remove that folder."""
    corpora = REPO / "corpora"
    before = sorted(p.relative_to(corpora) for p in corpora.rglob("*"))
    with pytest.raises(DataError) as info:
        KJVDataModule(str(corpora), batch_size=2, seq_len=64).prepare_data()
    message = str(info.value)
    assert "data.data_dir=" in message and "ships" in message
    assert "remov" not in message and "delet" not in message
    assert sorted(p.relative_to(corpora) for p in corpora.rglob("*")) == before
    assert common.ships_with_repository(corpora / "kjv") and not common.ships_with_repository(
        REPO / "data" / "x"
    )
