"""Data sources users bring: text datasets on disk, a pretrained tokenizer, pre-tokenized token files,
and the host-wide token cache they share.

Mechanism (`data.build_dataset` drives it; this module holds the pieces and never downloads):

1. **Text datasets** (`data.source=jsonl|parquet|hf_disk`). `text_source_files` lists the files
   (`data.paths` entries as given, directories expanded to their sorted `*.jsonl`/`*.json` or
   `*.parquet` files; for `hf_disk` every file of the `Dataset.save_to_disk` directory).
   `check_text_files` reads only what it must to fail early: the first JSON line of every JSONL
   file, the schema of every Parquet file, so an unknown `data.text_field` or a broken file is
   named before anything is loaded. `load_text_dataset` then loads them with Hugging Face
   `datasets` (local loaders, `HF_DATASETS_OFFLINE=1`; the Arrow copy of JSONL/Parquet lives in
   `<cache_dir>/hf-datasets`). Each row's `data.text_field` is one document (None = empty).
2. **Tokenizers** as a picklable `TokenizerSpec` (kind, path, end-of-text id) so worker
   processes load their own copy: `bytes` (UTF-8 bytes, no separator), `bpe` (a
   `tokenizers` JSON file, `<|endoftext|>` after every document) and `hf`
   (`AutoTokenizer.from_pretrained(data.tokenizer_path, local_files_only=True)`, its eos_token
   or `<|endoftext|>` after every document; `load_hf_tokenizer` checks that `len(tokenizer)`
   fits `model.vocab_size`). `tokenize_texts` encodes batches of documents in order, in
   `data.num_proc` spawned processes when > 1, logging progress every `PROGRESS_EVERY_S`.
3. **Token cache, once per host**. The key (`files_key`) hashes every file's path, size and
   mtime, the text field, the tokenizer's identity (`tokenizer_fingerprint`: a hash of its
   tokenizer files) and the vocab size. `build_once` takes an exclusive `fcntl.flock` on
   `<file>.lock` next to the cache file: the first process builds, the others block on the lock
   and then find the file (a builder that dies releases the lock and the next one builds).
   `write_token_npy` streams the chunks into a temp file with a fixed 128-byte `.npy` header
   (filled in once the length is known), fsyncs and renames it (`atomic_write`), so memory stays
   bounded by one chunk and no reader ever sees a partial file.
4. **Token files** (`data.source=tokens`): flat `.bin` files of `data.token_dtype` (nanoGPT's
   format) or 1-D integer `.npy` files, memory-mapped as they are (no copy, no cache). Several
   files are read as one array by `TokenFiles` (an offset index; a window may span two files).
   Their dtype must hold every id below `model.vocab_size`, and the first ids of every file
   (`CHECK_TOKENS` in all) are checked against it (a cheap sample: huge files are not scanned).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

__all__ = [
    "DataError",
    "TEXT_SOURCES",
    "CHECK_TOKENS",
    "PROGRESS_EVERY_S",
    "atomic_write",
    "build_once",
    "files_key",
    "write_token_npy",
    "load_token_cache",
    "load_hf_tokenizer",
    "tokenizer_fingerprint",
    "TokenizerSpec",
    "tokenize_texts",
    "text_source_files",
    "check_text_files",
    "load_text_dataset",
    "iter_text_batches",
    "TokenFiles",
    "open_token_files",
]

Log = Callable[[str], None]

TEXT_SOURCES = ("jsonl", "parquet", "hf_disk")
"""The data.source values read with Hugging Face `datasets`."""
CHECK_TOKENS = 1 << 22
"""Ids checked against model.vocab_size: the start of every token file, this many over all files
(8 MB of uint16), at least 64 Ki per file."""
PROGRESS_EVERY_S = 5.0
"""Seconds between two 'data: tokenised i/n documents' lines."""
BATCH_DOCS = 1000
"""Documents per tokenizer call (and per task of a worker process)."""
EOT_TOKEN = "<|endoftext|>"
"""The end-of-text token BPE appends to every document (and hf uses when it has no eos_token)."""
_SUFFIXES = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
_HEADER = 128  # bytes of the .npy header write_token_npy reserves (any 1-D length fits)


class DataError(ValueError):
    """A data problem, with a message that names the file or key and what to change."""


# ----------------------------------------------------------------------------- cache files


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


# ----------------------------------------------------------------------------- tokenizers


def load_hf_tokenizer(path: Optional[str], vocab_size: int) -> tuple[Any, int]:
    """(tokenizer, end-of-text id) of the saved tokenizer in `path`, checked against model.vocab_size."""
    if not path:
        raise DataError(
            "data.tokenizer is hf but data.tokenizer_path is not set: give the directory of a "
            "tokenizer saved with save_pretrained"
        )
    p = Path(path).expanduser()
    if not p.is_dir():
        raise DataError(
            f"data.tokenizer_path '{path}' is not a directory: give the directory of a tokenizer "
            "saved with save_pretrained"
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"data.tokenizer_path '{path}' could not be loaded as a tokenizer ({first})") from None
    if len(tok) > vocab_size:
        raise DataError(
            f"data.tokenizer_path '{path}' has {len(tok)} tokens but model.vocab_size is "
            f"{vocab_size}: set model.vocab_size >= {len(tok)}"
        )
    eos = tok.eos_token or (EOT_TOKEN if EOT_TOKEN in tok.get_vocab() else None)
    if eos is None:
        raise DataError(
            f"data.tokenizer_path '{path}' has no end-of-text token (no eos_token and no "
            f"{EOT_TOKEN}): save the tokenizer with an eos_token"
        )
    eos_id = tok.convert_tokens_to_ids(eos)
    assert isinstance(eos_id, int), eos_id
    return tok, eos_id


_TOKENIZER_FILES = {"vocab.json", "merges.txt", "vocab.txt", "special_tokens_map.json", "added_tokens.json"}


def tokenizer_fingerprint(path: str) -> str:
    """A hash of the tokenizer files in `path` (tokenizer*, vocab, merges, *.model; not the weights)."""
    h = hashlib.sha256()
    root = Path(path).expanduser()
    for f in sorted(root.iterdir()):
        if f.is_file() and (
            f.name.startswith("tokenizer") or f.name in _TOKENIZER_FILES or f.suffix in (".model", ".tiktoken")
        ):
            h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class TokenizerSpec:
    """What a (worker) process needs to rebuild the tokenizer: kind, file or directory, end-of-text id."""

    kind: str
    """`bytes`, `bpe` (path = tokenizers JSON file) or `hf` (path = save_pretrained directory)."""
    path: Optional[str] = None
    eot: Optional[int] = None
    """Id appended after every document (None: no separator)."""


_ENCODER: Optional[Callable[[list[str]], list[np.ndarray]]] = None


def _encoder(spec: TokenizerSpec) -> Callable[[list[str]], list[np.ndarray]]:
    eot = [] if spec.eot is None else [spec.eot]
    if spec.kind == "bytes":
        return lambda texts: [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    if spec.kind == "bpe":
        from tokenizers import Tokenizer

        bpe = Tokenizer.from_file(str(spec.path))
        return lambda texts: [
            np.asarray(e.ids + eot, dtype=np.int64) for e in bpe.encode_batch(texts, add_special_tokens=False)
        ]
    if spec.kind == "hf":
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(spec.path), local_files_only=True)
        return lambda texts: [
            np.asarray(ids + eot, dtype=np.int64)
            for ids in hf(texts, add_special_tokens=False, verbose=False)["input_ids"]
        ]
    raise DataError(f"data.tokenizer is '{spec.kind}'; choose bytes, bpe or hf")


def _init_worker(spec: TokenizerSpec) -> None:
    global _ENCODER
    _ENCODER = _encoder(spec)


def _encode_in_worker(texts: list[str]) -> np.ndarray:
    assert _ENCODER is not None
    out = _ENCODER(texts)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def tokenize_texts(
    batches: Iterable[list[str]],
    spec: TokenizerSpec,
    *,
    vocab_size: int,
    num_docs: int,
    num_proc: int = 1,
    log: Log = print,
) -> Iterator[np.ndarray]:
    """The token ids of every batch of documents, in order, one array per batch (ids < vocab_size)."""
    t0 = last = time.perf_counter()
    done = 0

    def checked(ids: np.ndarray, n: int) -> np.ndarray:
        nonlocal done, last
        if ids.size and int(ids.max()) >= vocab_size:
            raise DataError(
                f"data.tokenizer {spec.kind} produced id {int(ids.max())} >= model.vocab_size "
                f"({vocab_size}): raise model.vocab_size or use a smaller tokenizer"
            )
        done += n
        if time.perf_counter() - last >= PROGRESS_EVERY_S:
            last = time.perf_counter()
            log(f"data: tokenised {done}/{num_docs} documents ({last - t0:.0f} s)")
        return ids

    if num_proc <= 1:
        enc = _encoder(spec)
        for texts in batches:
            out = enc(texts)
            yield checked(np.concatenate(out) if out else np.zeros(0, np.int64), len(texts))
        return
    import multiprocessing

    sizes: list[int] = []

    def counted() -> Iterator[list[str]]:
        for texts in batches:
            sizes.append(len(texts))
            yield texts

    # spawn: a fresh interpreter per worker (no fork of torch's or the tokenizer's threads)
    with multiprocessing.get_context("spawn").Pool(num_proc, _init_worker, (spec,)) as pool:
        for i, ids in enumerate(pool.imap(_encode_in_worker, counted())):
            yield checked(ids, sizes[i])


# ----------------------------------------------------------------------------- text datasets


def _where(paths: Sequence[str]) -> str:
    return ", ".join(str(p) for p in paths)


def text_source_files(source: str, paths: Sequence[str]) -> list[Path]:
    """The files of a text dataset: `paths` in order, directories expanded (sorted)."""
    if not paths:
        raise DataError(
            f"data.source is {source} but data.paths is empty: list the dataset's files or directories in data.paths"
        )
    out: list[Path] = []
    for entry in paths:
        p = Path(entry).expanduser()
        if not p.exists():
            raise DataError(f"data.paths entry '{entry}' does not exist: fix the path or remove it from data.paths")
        if source == "hf_disk":
            if not p.is_dir():
                raise DataError(
                    f"data.paths entry '{entry}' is not a directory: data.source=hf_disk reads a "
                    "directory written by Dataset.save_to_disk"
                )
            out.extend(sorted(f for f in p.rglob("*") if f.is_file()))
        elif p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file()
                and f.name.endswith(_SUFFIXES[source])
                and not any(part.startswith(".") for part in f.relative_to(p).parts)
                and f.stat().st_size > 0
            )
            if not found:
                raise DataError(
                    f"data.paths entry '{entry}' has no non-empty "
                    f"{'/'.join('*' + s for s in _SUFFIXES[source])} files for data.source={source}"
                )
            out.extend(found)
        else:
            out.append(p)
    for f in out:
        if not os.access(f, os.R_OK):
            raise DataError(f"data.paths file '{f}' is unreadable (permission denied): fix its permissions")
        if source != "hf_disk" and f.stat().st_size == 0:
            raise DataError(f"data.paths file '{f}' is empty: remove it from data.paths")
    return out


def _columns_error(field: str, where: object, columns: Iterable[str]) -> DataError:
    return DataError(f"data.text_field '{field}' is not a column of {where}: columns are {', '.join(columns)}")


def check_text_files(source: str, files: Sequence[Path], text_field: str) -> None:
    """Fail early on a JSONL/Parquet file that cannot be read or lacks `text_field` (reads little)."""
    for f in files:
        if source == "jsonl":
            try:
                with open(f, "rb") as fh:
                    line = next((raw for raw in fh if raw.strip()), b"")
                row = json.loads(line) if line else None
            except (ValueError, OSError) as err:
                if f.suffix == ".json":
                    continue  # maybe one JSON document over many lines: datasets reads (or rejects) it
                raise DataError(f"data.paths file '{f}' is not JSON lines ({err}): one JSON object per line") from None
            if not isinstance(row, dict):
                raise DataError(f"data.paths file '{f}' is not JSON lines: its first line is not a JSON object")
            if text_field not in row:
                raise _columns_error(text_field, f, row)
        elif source == "parquet":
            import pyarrow.parquet as pq

            try:
                names = pq.read_schema(f).names
            except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
                raise DataError(f"data.paths file '{f}' is not a readable Parquet file ({err})") from None
            if text_field not in names:
                raise _columns_error(text_field, f, names)


def _datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    return datasets


def load_text_dataset(source: str, paths: Sequence[str], text_field: str, *, cache_dir: Path, log: Log = print) -> Any:
    """The `datasets.Dataset` of a jsonl / parquet / hf_disk source, with `text_field` checked."""
    datasets = _datasets()
    files = text_source_files(source, paths)
    check_text_files(source, files, text_field)
    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        if source == "hf_disk":
            ds = datasets.load_from_disk(str(Path(paths[0]).expanduser()))
            if isinstance(ds, datasets.DatasetDict):
                raise DataError(
                    f"data.paths[0] '{paths[0]}' holds a DatasetDict with splits {', '.join(ds)}: "
                    f"give the directory of one split (e.g. {paths[0]}/{next(iter(ds), 'train')})"
                )
        else:
            ds = datasets.load_dataset(
                "json" if source == "jsonl" else source,
                data_files=[str(f) for f in files],
                split="train",
                cache_dir=str(cache_dir),
            )
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets wraps reader errors in its own types
        cause = err.__cause__ or err
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise DataError(f"data.paths {_where(paths)} could not be read as data.source={source} ({first})") from None
    finally:
        if not quiet:
            datasets.enable_progress_bars()
    if text_field not in ds.column_names:
        raise _columns_error(text_field, _where(paths), ds.column_names)
    dtype = getattr(ds.features[text_field], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise DataError(
            f"data.text_field '{text_field}' of {_where(paths)} holds {ds.features[text_field]} values, "
            f"not text: choose a text column (columns are {', '.join(ds.column_names)})"
        )
    if len(ds) == 0:
        raise DataError(f"data.paths {_where(paths)} hold no documents: add rows with a '{text_field}' field")
    log(f"data: {len(ds)} documents in {len(files)} {source} files")
    return ds


def iter_text_batches(ds: Any, text_field: str, batch_size: Optional[int] = None) -> Iterator[list[str]]:
    """The documents of `ds` in row order, `batch_size` (default BATCH_DOCS) at a time (None = empty document)."""
    for batch in ds.select_columns([text_field]).iter(batch_size=batch_size or BATCH_DOCS):
        yield ["" if t is None else t for t in batch[text_field]]


# ----------------------------------------------------------------------------- token files


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
