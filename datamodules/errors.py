"""The one exception type for data a user can fix: missing files, bad layouts, corrupt or unreadable items.

``run.py`` prints a ``DataError`` as one line (no traceback) and exits non-zero, so its message must name the
file or configuration key to change and what was expected. It subclasses ``ValueError`` so existing
``except ValueError`` callers keep working.
"""

from __future__ import annotations


class DataError(ValueError):
    """User-fixable data problem; the message names the file or key and what was expected."""
