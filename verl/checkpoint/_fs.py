"""Durability primitives: a checkpoint is only as atomic as the fsyncs and renames under it.

A rename is atomic on POSIX, but without an fsync of the file *and* of its directory a power cut can
leave the new name pointing at an empty file. Every write that is part of a commit goes through here.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_CHUNK = 4 * 1024 * 1024


def fsync_dir(path: Path) -> None:
    """Persist a directory entry (new file, rename) so that it survives a crash."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems (and Windows) cannot open a directory; nothing more to do
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush one file's data to stable storage."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_tree(root: Path, *, files: bool = True) -> None:
    """fsync every directory (and, with ``files``, every file) below ``root``, bottom-up.

    ``files=False`` is for trees whose files their writers already fsynced (each rank its own: an fsync
    from another NFS client would not flush them anyway).
    """
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        if files:
            for name in filenames:
                fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def write_bytes_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the caller fsyncs the directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so a reader sees either the old or the new content, never half."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    write_bytes_durable(tmp, text.encode("utf-8"))
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed so that multi-GB shards do not need to fit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
