"""The errors a user can fix, one base for all: ``run.py`` and the tools print a ``UserError`` as one ``error:``
line and exit 2 (no traceback), so its message names the key, value or file and what was expected."""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in what a user asked for; the message says what and how to fix it."""


class ConfigError(UserError):
    """A recipe or override a user wrote is wrong."""


class CheckpointError(UserError):
    """A checkpoint a user named that cannot be used."""


class MissingCheckpointError(CheckpointError, FileNotFoundError):
    """A checkpoint named by ``ckpt=``, ``init_from=``, ``resume=`` or a tool that does not exist."""


class RunFolderError(UserError):
    """A folder a command would write into that it must not (another run, a user's files, one in use)."""
