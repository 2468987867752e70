"""Durable renames: flush a file or directory entry to disk by path.

A file written and then renamed into place is durable only once its data, and the directory
holding the new name, reached the disk; the adapter store and the journal's creation both
publish that way.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_path"]


def fsync_path(path: str | os.PathLike[str]) -> None:
    """``fsync`` the file or directory at ``path`` (a directory: the names in it)."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
