"""Whole-file writes on a local filesystem: readers see the old content or the new one, never a torn mix,
and a written file survives a power cut (fsync of the file, then of its folder after the rename)."""
from __future__ import annotations

import errno
import json
import os
import uuid
from typing import Any


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return  # some filesystems do not open folders; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_temp(path: str, data: bytes) -> str:
    """`data` in a fresh, fsynced temporary file beside `path`; returns its name."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def atomic_write(path: str, data: bytes) -> None:
    """Replace `path` with `data`, whole."""
    tmp = write_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def atomic_create(path: str, data: bytes) -> None:
    """Create `path` with `data` only if it does not exist (FileExistsError otherwise). A hard link fails if
    `path` exists, and `path` never exists empty; on a filesystem without hard links, O_EXCL (whose file
    shows empty until written: readers of such files look again)."""
    tmp = write_temp(path, data)
    try:
        os.link(tmp, path)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        with open(path, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    finally:
        os.unlink(tmp)
    _fsync_dir(os.path.dirname(path))


def write_json(path: str, obj: Any) -> None:
    """A JSON file (sorted keys, indented) written whole."""
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
