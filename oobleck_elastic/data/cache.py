"""The per-host token cache: files built once per host, written atomically, read memory-mapped.

The key of a cache file (`files_key`) hashes every input file's path, size and mtime and whatever
else decides its content (the text field, the tokenizer's identity, the vocab size). `build_once`
takes an exclusive `fcntl.flock` on `<file>.lock` next to the cache file: of the workers of a host
that start together, the first builds and the others block on the lock and then find the file (a
builder that dies releases the lock and the next one builds). `write_token_npy` streams chunks
into a temp file with a fixed 128-byte `.npy` header (filled in once the length is known), fsyncs
and renames it (`atomic_write`), so memory stays bounded by one chunk and no reader ever sees a
partial file; `load_token_cache` memory-maps it. The story: docs/training.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from .errors import DataError

Log = Callable[[str], None]
"""Where progress lines go (`print`, or a logger's `info`)."""

__all__ = ["Log", "atomic_write", "build_once", "files_key", "write_token_npy", "load_token_cache"]


_HEADER = 128  # bytes of the .npy header write_token_npy reserves (any 1-D length fits)


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Call write(fileobj) on a temp file next to `path`, fsync it and rename it to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def build_once(
    path: Path, build: Callable[[], None], *, log: Log = print, also: Optional[Callable[[], bool]] = None
) -> bool:
    """Make sure `path` exists, calling build() (which writes it atomically) in one process of the host.

    Returns True when this process built it. Others wait on an flock of `<path>.lock` meanwhile.
    `also`: a further condition for an existing file to count (else it is rebuilt).
    """

    def done() -> bool:
        return path.is_file() and (also is None or also())

    if done():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{path.name}.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"data: waiting for another process to build {path}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as err:  # a file system without flock: every process builds, writes stay atomic
            log(f"data: cannot lock {lock.name} ({err.strerror}); building without the lock")
        if done():
            return False
        build()
        return True  # closing the file releases the lock


def files_key(files: Sequence[Path], *extra: object) -> str:
    """A cache key over the files' paths, sizes and mtimes and `extra`."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{Path(f).resolve().as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(json.dumps([str(e) for e in extra]).encode())
    return h.hexdigest()[:16]


def _npy_header(dtype: np.dtype, n: int) -> bytes:
    body = f"{{'descr': '{dtype.str}', 'fortran_order': False, 'shape': ({n},), }}"
    body = body.ljust(_HEADER - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1")


def write_token_npy(path: Path, chunks: Iterable[np.ndarray], dtype: Any) -> int:
    """Stream 1-D chunks into the .npy file `path` (atomically); returns the number of tokens."""
    dt, count = np.dtype(dtype).newbyteorder("<"), 0

    def write(fh: Any) -> None:
        nonlocal count
        fh.write(b"\0" * _HEADER)
        for chunk in chunks:
            fh.write(np.ascontiguousarray(chunk, dtype=dt).tobytes())
            count += len(chunk)
        fh.seek(0)
        fh.write(_npy_header(dt, count))

    atomic_write(path, write)
    return count


def load_token_cache(path: Path) -> np.ndarray:
    """The cached token array at `path`, memory-mapped."""
    try:
        return np.load(path, mmap_mode="r")
    except (ValueError, OSError) as err:
        raise DataError(f"token cache '{path}' is unreadable ({err}); delete it to rebuild") from None
