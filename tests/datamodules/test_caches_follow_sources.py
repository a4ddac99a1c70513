"""Caches follow their inputs (issue 32): every derived cache records the signature of the files it was built
from (path, size, modification time: ``common.source_signature``), and a changed, added or removed source
rebuilds it; KJV has the read-only fallback of the other data modules, and its own message for an empty
``kjv/``. (A KJV book replaced with garbage after the first tokenisation used to train on the old tokens.)"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from modality_fixtures import write_pg19, write_speech_commands, write_wikitext

from datamodules import DataError, KJVDataModule
from datamodules.common import source_signature
from datamodules.kjv import unpack
from datamodules.pg19 import PG19DataModule


def _touch_later(path: Path) -> None:
    """A new modification time even on a file system with coarse timestamps."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


def test_the_signature_changes_with_any_changed_added_or_removed_file(tmp_path):
    files = []
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(name)
        files.append(tmp_path / name)
    first = source_signature(files, tmp_path)
    assert source_signature(list(reversed(files)), tmp_path) == first  # order does not matter
    _touch_later(files[0])
    assert source_signature(files, tmp_path) != first
    touched = source_signature(files, tmp_path)
    files[1].write_text("bb")  # a new size
    assert source_signature(files, tmp_path) != touched
    (tmp_path / "c.txt").write_text("c")
    assert source_signature([*files, tmp_path / "c.txt"], tmp_path) != source_signature(files, tmp_path)


def _pg19(root: Path) -> PG19DataModule:
    dm = PG19DataModule(str(root), batch_size=2, seq_len=32, vocab_size=300)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_pg19_tokens_and_trained_tokenizer_follow_the_books(tmp_path):
    texts = write_pg19(tmp_path)
    dm = _pg19(tmp_path)
    meta = dm.token_dir / "meta.json"
    built = meta.stat().st_mtime_ns
    tokens = len(dm.streams["train"])
    model = dm._trained_model_path()
    trained = model.read_bytes()

    _pg19(tmp_path)  # nothing changed: nothing rebuilt
    assert meta.stat().st_mtime_ns == built and model.read_bytes() == trained

    train = tmp_path / "pg19" / "train"
    book = sorted(train.glob("*.txt"))[0]
    book.write_text(texts["train"][book.stem] + "\nAn added closing line of new words: zebra quokka.\n")
    dm = _pg19(tmp_path)
    assert len(dm.streams["train"]) > tokens  # the changed book was tokenised again
    assert model.with_suffix(".sources").read_text().strip() == dm.sources(("train",))  # tokenizer retrained
    assert json.loads((dm.token_dir / "meta.json").read_text())["sources"] == dm.sources()

    shutil.copy(book, train / "9999.txt")  # an added book
    assert len(_pg19(tmp_path).book_offsets["train"]) == len(texts["train"]) + 2
    (train / "9999.txt").unlink()  # removed again
    assert len(_pg19(tmp_path).book_offsets["train"]) == len(texts["train"]) + 1

    held = sorted((tmp_path / "pg19" / "validation").glob("*.txt"))[0]
    held.write_bytes(b"\xff\xfe not UTF-8")  # an evaluation book replaced with garbage
    with pytest.raises(DataError, match=rf"{held.name}.*not valid UTF-8"):
        _pg19(tmp_path)


def test_kjv_book_replaced_after_tokenisation_is_read_again(tmp_path):
    """The issue's case: the committed corpus tokenised once, then a book replaced with garbage. The run used
    to train on the old tokens with exit 0; now the cache is rebuilt and the garbage is one DataError."""
    dm = KJVDataModule(str(tmp_path), batch_size=2, seq_len=64)
    dm.prepare_data()
    book = sorted((tmp_path / "kjv" / "train").glob("*.txt"))[3]
    book.write_bytes(os.urandom(2000) + b"\xff")
    with pytest.raises(DataError, match=rf"kjv/train/{book.name}:1 is not valid UTF-8"):
        KJVDataModule(str(tmp_path), batch_size=2, seq_len=64).prepare_data()


def test_kjv_read_only_data_dir_uses_the_user_cache(tmp_path, monkeypatch):
    """KJV passed its cache directory explicitly, so a read-only data directory raised PermissionError; now
    its caches (and, where kjv/ is absent, the unpacked corpus) go to the per-user cache like the others'."""
    import datamodules.common as common
    import datamodules.kjv as kjv

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    shared = tmp_path / "shared"
    unpack(shared)  # a shared copy someone unpacked; read-only from here on
    before = {p: p.stat().st_mtime_ns for p in shared.rglob("*")}
    inside = lambda p: Path(p).resolve().is_relative_to(shared.resolve())  # noqa: E731
    real = common.is_writable
    monkeypatch.setattr(common, "is_writable", lambda p: not inside(p) and real(p))
    monkeypatch.setattr(kjv, "is_writable", common.is_writable)
    dm = KJVDataModule(str(shared), batch_size=2, seq_len=64)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.cache_dir.is_relative_to(tmp_path / "user-cache") and len(dm.streams["train"]) > 0
    assert {p: p.stat().st_mtime_ns for p in shared.rglob("*")} == before  # nothing written there

    empty = tmp_path / "empty-shared"  # read-only and without kjv/: unpacked into the user cache
    empty.mkdir()
    monkeypatch.setattr(
        common, "is_writable", lambda p: not Path(p).resolve().is_relative_to(empty.resolve())
    )
    monkeypatch.setattr(kjv, "is_writable", common.is_writable)
    dm = KJVDataModule(str(empty), batch_size=2, seq_len=64)
    dm.prepare_data()
    assert dm.root.is_relative_to(tmp_path / "user-cache") and not list(empty.iterdir())


def test_an_empty_kjv_folder_gets_kjvs_own_message(tmp_path):
    (tmp_path / "kjv").mkdir()
    with pytest.raises(
        DataError, match=r"data\.data_dir=.*kjv holds no King James Bible.*remove the folder"
    ) as info:
        KJVDataModule(str(tmp_path), batch_size=2, seq_len=64).prepare_data()
    assert "PG-19" not in str(info.value)


def test_wikitext_cache_follows_its_files(tmp_path):
    from datamodules.wikitext import WikiText103DataModule

    write_wikitext(tmp_path)
    dm = WikiText103DataModule(str(tmp_path), batch_size=2, seq_len=16)
    dm.prepare_data()
    dm.setup("fit")
    words = dm.num_words["val"]
    valid = tmp_path / "wikitext-103" / "wiki.valid.tokens"
    valid.write_text(valid.read_text() + " the zeppelin flies again over the tower . \n")
    dm = WikiText103DataModule(str(tmp_path), batch_size=2, seq_len=16)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.num_words["val"] > words


def test_speech_cache_follows_its_clips(tmp_path):
    import soundfile

    from datamodules.speech import SpeechCommandsDataModule

    clips = write_speech_commands(tmp_path)
    dm = SpeechCommandsDataModule(str(tmp_path), batch_size=2)
    dm.prepare_data()
    meta = dm.cache_dir / "meta.json"
    assert json.loads(meta.read_text())["clips"] == len(clips["full"])
    time.sleep(0.01)
    extra = tmp_path / "speech_commands_v0.02" / "yes" / "ffffffff_nohash_9.wav"
    soundfile.write(extra, np.zeros(16000, np.int16), 16000, subtype="PCM_16")
    dm = SpeechCommandsDataModule(str(tmp_path), batch_size=2)
    dm.prepare_data()
    assert json.loads(meta.read_text())["clips"] == len(clips["full"]) + 1
