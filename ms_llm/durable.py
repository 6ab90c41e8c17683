"""Durable writes, shared by checkpoints and datasets: a file is either absent, its old content
or all of its new content, and a rename is on disk before anything that names its result."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, final: Path) -> None:
    """fsync the finished file `tmp`, rename it to `final`, fsync the folder."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)


def write_durable(path: Path, data: bytes) -> None:
    """Write-fsync-rename through `path`.part. O_NOFOLLOW: a symbolic link planted at the
    temporary name fails the write instead of redirecting it."""
    part = Path(path).with_name(Path(path).name + ".part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    replace_durably(part, path)
