"""Durable renames: flush a file or directory entry to disk by path.

A file written and then renamed into place is durable only once its data, and the directory
holding the new name, reached the disk; the adapter store and the journal's creation both
publish that way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["fsync_path", "fsync_paths"]


def fsync_path(path: str | os.PathLike[str]) -> None:
    """``fsync`` the file or directory at ``path`` (a directory: the names in it)."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_paths(paths: Sequence[str | os.PathLike[str]]) -> None:
    """``fsync`` every path at once, one thread each; return when all are on disk.

    For files that must all be durable before one rename publishes them: their order does not
    matter, and a journaling filesystem commits concurrent fsyncs together (on ext4 three files
    and their directory took 8 ms at once against 20 ms one after another). The first error is
    raised once every fsync ended.
    """
    if len(paths) <= 1:
        for path in paths:
            fsync_path(path)
        return
    with ThreadPoolExecutor(max_workers=len(paths), thread_name_prefix="fsync") as pool:
        futures = [pool.submit(fsync_path, path) for path in paths]
    for future in futures:
        future.result()
