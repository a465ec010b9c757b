"""Pre-tokenized token files (`data.source=tokens`), memory-mapped as they are (no copy, no cache).

Flat `.bin` files of `data.token_dtype` (nanoGPT's format) or 1-D integer `.npy` files. Several
files are read as one array by `TokenFiles` (an offset index; a window may span two files). Their
dtype must hold every id below `model.vocab_size`, and the first ids of every file
(`CHECK_TOKENS` in all) are checked against it (a cheap sample: huge files are not scanned).
`dtype_for_vocab` is the dtype the caches store token ids in (uint16, or uint32 for a vocab over
65536). The story: docs/training.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import DataError

__all__ = ["CHECK_TOKENS", "TokenFiles", "open_token_files", "dtype_for_vocab"]


CHECK_TOKENS = 1 << 22
"""Ids checked against model.vocab_size: the start of every token file, this many over all files
(8 MB of uint16), at least 64 Ki per file."""


class TokenFiles:
    """Several 1-D token arrays read as one, without copying: an offset index over memory maps."""

    def __init__(self, arrays: Sequence[np.ndarray], files: Sequence[Path]) -> None:
        self.arrays, self.files = list(arrays), list(files)
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])
        self.dtype = np.result_type(*[a.dtype for a in self.arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            first = int(np.searchsorted(self.offsets, start, side="right")) - 1
            pieces = []
            for k in range(max(first, 0), len(self.arrays)):
                lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
                if lo >= stop:
                    break
                pieces.append(self.arrays[k][max(start, lo) - lo : min(stop, hi) - lo])
            out = np.concatenate(pieces).astype(self.dtype, copy=False) if pieces else np.zeros(0, self.dtype)
            return out[::step] if step != 1 else out
        i = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"token {key} is out of range: the files hold {len(self)} tokens")
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.arrays[k][i - int(self.offsets[k])]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.concatenate(self.arrays)
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"TokenFiles({len(self.files)} files, {len(self)} tokens, {self.dtype})"


def _token_file_paths(paths: Sequence[str]) -> list[Path]:
    if not paths:
        raise DataError("data.source is tokens but data.paths is empty: list .bin or .npy token files")
    out: list[Path] = []
    for entry in paths:
        p = Path(entry).expanduser()
        if not p.exists():
            raise DataError(f"data.paths entry '{entry}' does not exist: fix the path or remove it from data.paths")
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".bin", ".npy"))
            if not found:
                raise DataError(f"data.paths entry '{entry}' has no .bin or .npy token files")
            out.extend(found)
        else:
            out.append(p)
    return out


def _open_token_file(f: Path, token_dtype: str, vocab_size: int, check: int = CHECK_TOKENS) -> np.ndarray:
    if not os.access(f, os.R_OK):
        raise DataError(f"token file '{f}' is unreadable (permission denied): fix its permissions")
    size = f.stat().st_size
    if size == 0:
        raise DataError(f"token file '{f}' is empty: remove it from data.paths")
    if f.suffix == ".npy":
        try:
            arr = np.load(f, mmap_mode="r")
        except (ValueError, OSError) as err:
            raise DataError(f"token file '{f}' is not a readable .npy file ({err})") from None
        if arr.ndim != 1 or arr.dtype.kind not in "ui":
            raise DataError(
                f"token file '{f}' holds a {arr.ndim}-D {arr.dtype} array: save a flat 1-D array of integer token ids"
            )
        if np.iinfo(arr.dtype).max < vocab_size - 1:
            raise DataError(
                f"token file '{f}' holds {arr.dtype} ids (at most {np.iinfo(arr.dtype).max}) but "
                f"model.vocab_size is {vocab_size}: save it as uint32"
            )
    elif f.suffix == ".bin":
        dt = np.dtype(token_dtype)
        if np.iinfo(dt).max < vocab_size - 1:
            raise DataError(
                f"token file '{f}' is read as data.token_dtype={token_dtype} (ids up to "
                f"{np.iinfo(dt).max}) but model.vocab_size is {vocab_size}: write the files as uint32 "
                "and set data.token_dtype=uint32"
            )
        if size % dt.itemsize:
            raise DataError(
                f"token file '{f}' has {size} bytes, not a multiple of {dt.itemsize} "
                f"(data.token_dtype={token_dtype}): check data.token_dtype"
            )
        arr = np.memmap(f, dtype=dt, mode="r")
    else:
        raise DataError(
            f"token file '{f}' is neither .bin nor .npy: data.source=tokens reads flat .bin files "
            "(dtype data.token_dtype) or 1-D .npy files"
        )
    top = int(arr[:check].max())
    if top >= vocab_size:
        raise DataError(
            f"token file '{f}' has token id {top} >= model.vocab_size ({vocab_size}) in its first "
            f"{min(len(arr), check)} tokens: raise model.vocab_size or check data.token_dtype"
        )
    return arr


def open_token_files(paths: Sequence[str], token_dtype: str, vocab_size: int) -> np.ndarray | TokenFiles:
    """The token ids of `paths` in order, memory-mapped: the array itself for one file, else a TokenFiles."""
    files = _token_file_paths(paths)
    check = max(1 << 16, CHECK_TOKENS // len(files))
    arrays = [_open_token_file(f, token_dtype, vocab_size, check) for f in files]
    return arrays[0] if len(arrays) == 1 else TokenFiles(arrays, files)


def dtype_for_vocab(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 65536 else np.uint32
