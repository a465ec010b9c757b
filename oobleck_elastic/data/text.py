"""Text datasets users bring (`data.source=jsonl|parquet|hf_disk`), tokenized once per host.

A broken file or an unknown `data.text_field` is named before anything is loaded, and this module
never downloads. The story: docs/training.md.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np

from ..config import JobConfig
from .cache import Log, build_once, files_key, load_token_cache, write_token_npy
from .errors import DataError
from .tokenizer import BATCH_DOCS, TokenizerFiles, TokenizerSpec, hf_spec, tokenize_texts
from .tokens import dtype_for_vocab
from .tokenizer import EOT_TOKEN, load_or_train_bpe

__all__ = [
    "TEXT_SOURCES",
    "text_source_files",
    "check_text_files",
    "load_text_dataset",
    "iter_text_batches",
    "text_source_tokens",
]


TEXT_SOURCES = ("jsonl", "parquet", "hf_disk")
"""The data.source values read with Hugging Face `datasets`."""
_SUFFIXES = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}


# ----------------------------------------------------------------------------- cache files


# ----------------------------------------------------------------------------- tokenizers


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


def text_source_tokens(cfg: JobConfig, log: Log) -> tuple[np.ndarray, TokenizerFiles]:
    """The token cache of source=jsonl/parquet/hf_disk (built once per host), and where its
    tokenizer is."""
    d, vocab = cfg.data, cfg.model.vocab_size
    cache = Path(d.cache_dir).expanduser()
    files = text_source_files(d.source, d.paths)
    tok_path = cache / "tokenizers" / f"{files_key(files, d.source, d.text_field, 'bpe', vocab)}.json"
    if d.tokenizer == "hf":
        spec, ident = hf_spec(d, vocab)
    else:
        spec, ident = TokenizerSpec(d.tokenizer), (f"bpe:{tok_path.stem}" if d.tokenizer == "bpe" else "bytes")
    token_path = cache / "tokens" / f"{files_key(files, d.source, d.text_field, ident, vocab)}.npy"
    has_tokenizer = tok_path.is_file if d.tokenizer == "bpe" else None

    def build() -> None:
        nonlocal spec
        t0 = time.perf_counter()
        ds = load_text_dataset(d.source, d.paths, d.text_field, cache_dir=cache / "hf-datasets", log=log)
        if d.tokenizer == "bpe":
            docs = [t.encode("utf-8") for texts in iter_text_batches(ds, d.text_field) for t in texts]
            tok = load_or_train_bpe(docs, vocab_size=vocab, path=tok_path, log=log)
            spec = TokenizerSpec("bpe", str(tok_path), tok.token_to_id(EOT_TOKEN))
        log(f"data: tokenising {len(ds)} documents with data.tokenizer={d.tokenizer} (data.num_proc={d.num_proc})")
        chunks = tokenize_texts(
            iter_text_batches(ds, d.text_field), spec, vocab_size=vocab, num_docs=len(ds), num_proc=d.num_proc, log=log
        )
        n = write_token_npy(token_path, chunks, dtype_for_vocab(vocab))
        log(f"data: {n} tokens cached in {time.perf_counter() - t0:.1f} s -> {token_path}")

    built = build_once(token_path, build, log=log, also=has_tokenizer)
    tokens = load_token_cache(token_path)
    if not built:
        log(f"data: {len(files)} {d.source} files, {len(tokens)} tokens (cached {token_path})")
    path = str(tok_path.resolve()) if d.tokenizer == "bpe" else spec.path if d.tokenizer == "hf" else None
    return tokens, TokenizerFiles(d.tokenizer, path)
