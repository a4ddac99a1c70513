"""Files and folders written whole or not at all.

- ``write_text``: a small file through a temporary name and a rename.
- ``keep_previous`` / ``replace_checkpoint`` / ``recover_checkpoint``: a checkpoint replaced by rename, the one
  it replaces kept one generation back (``<path>.prev``), so that a kill at any moment leaves a whole one.
- ``new_output``: what a tool writes (an export's folder, a consolidated file, a report folder) is built
  under a temporary name beside its destination and renamed into place when complete. A destination that
  exists is refused unless the caller allows replacing it (an explicit ``--overwrite``, and only a
  destination of the same kind: a bundle by a bundle), so nothing of a user's is lost to a typo.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from mega_suite.errors import UserError
from mega_suite.storage.layout import PREVIOUS, is_run_folder


def remove_path(path: Path) -> None:
    """Delete a file or a folder (a sharded checkpoint), if present."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_text(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, or keeps what it held (a temporary file renamed over it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def previous_of(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + PREVIOUS)


def keep_previous(path: Path, move: bool = False) -> None:
    """Before ``path`` is replaced: its current content becomes ``<path>.prev`` (a hard link where the file
    system has them, so that ``path`` itself never disappears; a rename otherwise, or with ``move``)."""
    path = Path(path)
    if not path.exists():
        return
    prev = previous_of(path)
    remove_path(prev)
    if path.is_file() and not move:
        try:
            os.link(path, prev)
            return
        except OSError:
            pass
    os.replace(path, prev)


def replace_checkpoint(tmp: Path, path: Path) -> None:
    """Put the finished checkpoint ``tmp`` (file or sharded folder) at ``path``. A folder cannot be replaced
    in one rename: the previous one moves to ``<path>.prev`` first (kept, one generation back), so a kill at
    any moment leaves ``path`` or ``<path>.prev`` whole (``resume=auto`` falls back to it)."""
    tmp, path = Path(tmp), Path(path)
    keep_previous(path, move=tmp.is_dir() or path.is_dir())
    os.replace(tmp, path)


def recover_checkpoint(path: Path) -> Path:
    """A save killed between the two renames of an older ``replace_checkpoint`` left only ``<path>.old``: put
    it back."""
    path = Path(path)
    old = path.with_name(path.name + ".old")
    if not path.exists() and old.exists():
        os.replace(old, path)
        print(
            f"[mega-suite] {path}: an interrupted save left the previous checkpoint in {old.name}; restored"
        )
    return path


@contextlib.contextmanager
def new_output(
    dest: Path,
    key: str,
    folder: bool,
    overwrite: bool = False,
    same_kind: Callable[[Path], bool] | None = None,
) -> Iterator[Path]:
    """Yield a temporary path beside ``dest`` to write into; on success it is renamed to ``dest``, on any
    failure (an error, Ctrl-C) removed. ``dest`` must not exist, unless ``overwrite`` and ``same_kind(dest)``
    (then it is replaced only once the new one is complete)."""
    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        kind = "folder" if dest.is_dir() else "file"
        if not overwrite:
            raise UserError(
                f"{key}={dest} exists; nothing is overwritten without --overwrite (or choose a new {kind})"
            )
        if same_kind is not None and not same_kind(dest):
            raise UserError(
                f"{key}={dest} exists and is not what this command writes; it is never replaced, even with "
                "--overwrite: choose a new path"
            )
    if not dest.parent.exists():
        try:
            dest.parent.mkdir(parents=True)
        except OSError as exc:
            raise UserError(f"{key}={dest}: cannot create {dest.parent} ({exc.strerror or exc})") from None
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    remove_path(tmp)
    try:
        if folder:
            tmp.mkdir()
        yield tmp
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
            os.replace(tmp, dest)
            remove_path(old)
        else:
            os.replace(tmp, dest)
    finally:
        remove_path(tmp)


@contextlib.contextmanager
def new_files(folder: Path, names: list[str], key: str = "--out", overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder in which to write the report files ``names``; on success each is renamed into
    ``folder`` (created if missing), on failure none is. Files of those names already in ``folder`` are refused
    unless ``overwrite``; a folder that is or lies in a training run is refused (a run holds what training
    wrote)."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{key}={folder} is a file, not a folder")
    inside = next((p for p in [folder, *folder.resolve().parents] if is_run_folder(p)), None)
    if inside is not None:
        raise UserError(
            f"{key}={folder} is in the training run {inside}; write reports outside any run folder"
        )
    there = [n for n in names if (folder / n).exists()]
    if there and not overwrite:
        raise UserError(
            f"{key}={folder} already holds {', '.join(there)}; nothing is overwritten without --overwrite"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{key}={folder}: cannot create it ({exc.strerror or exc})") from None
    tmp = folder / f".report.tmp-{os.getpid()}"
    remove_path(tmp)
    tmp.mkdir()
    try:
        yield tmp
        for name in names:
            if (tmp / name).exists():
                os.replace(tmp / name, folder / name)
    finally:
        remove_path(tmp)
