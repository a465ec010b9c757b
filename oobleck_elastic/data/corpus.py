"""The built-in corpora (`data.source=stdlib|files`), their tokenizer and their token cache.

Invariant: no reader ever sees a partial cache file (temporary name, fsync, rename), and of the
workers of a host that start together one tokenises while the others wait. The story:
docs/training.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..config import JobConfig
from .cache import Log, atomic_write, build_once, load_token_cache, write_token_npy
from .errors import DataError
from .tokenizer import BATCH_DOCS, EOT_TOKEN, TokenizerFiles, hf_spec, tokenize_texts
from .tokens import dtype_for_vocab
from .tokenizer import load_or_train_bpe

__all__ = ["STDLIB_MAX_BYTES", "STDLIB_EXCLUDE", "corpus_files", "read_corpus", "tokenize_corpus", "corpus_tokens"]


STDLIB_MAX_BYTES = 8 * 1024 * 1024
"""Default corpus cap for source=stdlib: part of the standard library, so tests and demos stay fast."""


STDLIB_EXCLUDE = frozenset(
    {"test", "tests", "idlelib", "idle_test", "lib2to3", "site-packages", "dist-packages", "__pycache__"}
)
"""Directory names skipped when collecting the stdlib corpus."""


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as fh:
        return b"\0" in fh.read(8192)


def _walk(root: Path) -> list[Path]:
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out.extend(Path(dirpath) / f for f in filenames if not f.startswith("."))
    return out


def corpus_files(source: str, paths: Sequence[str] = ()) -> list[Path]:
    """The corpus files of `source` (`stdlib` or `files`), sorted by path."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in root.rglob("*.py") if not STDLIB_EXCLUDE.intersection(p.relative_to(root).parts[:-1])]
        if not files:
            raise DataError(
                f"data.source=stdlib: no .py files under '{root}' (the Python "
                "standard library); use data.source=files with data.paths"
            )
        return sorted(files, key=lambda p: p.relative_to(root).as_posix())
    if source != "files":
        raise DataError(f"data.source is '{source}'; choose stdlib or files")
    if not paths:
        raise DataError("data.source is files but data.paths is empty: list text files or directories in data.paths")
    found: set[Path] = set()
    for entry in paths:
        p = Path(entry).expanduser()
        if not p.exists():
            raise DataError(f"data.paths entry '{entry}' does not exist: fix the path or remove it from data.paths")
        if p.is_dir():
            found.update(f.resolve() for f in _walk(p) if f.is_file() and not _is_binary(f))
        else:
            found.add(p.resolve())
    files = sorted(f for f in found if f.stat().st_size > 0)
    if not files:
        raise DataError(
            f"data.paths {list(paths)} contain no non-empty text files: add text "
            "files (binary and hidden files are skipped in directories)"
        )
    return files


def _capped(files: Sequence[Path], max_bytes: int | None) -> list[tuple[Path, int]]:
    """(file, bytes to read) for the files that fit under `max_bytes` (None/0 = no cap)."""
    out, total = [], 0
    for f in files:
        size = f.stat().st_size
        if max_bytes and total + size > max_bytes:
            if max_bytes - total > 0:
                out.append((f, max_bytes - total))
            break
        out.append((f, size))
        total += size
    return out


def read_corpus(parts: Sequence[tuple[Path, int]]) -> list[bytes]:
    """The documents: the first n bytes of every (file, n)."""
    docs = []
    for f, n in parts:
        with open(f, "rb") as fh:
            docs.append(fh.read(n))
    return docs


def _corpus_key(parts: Sequence[tuple[Path, int]], *extra: object) -> str:
    h = hashlib.sha256()
    for f, n in parts:
        h.update(f"{f.as_posix()}\0{n}\n".encode())
    h.update(json.dumps([str(e) for e in extra]).encode())
    return h.hexdigest()[:16]


def tokenize_corpus(
    docs: Sequence[bytes], *, tokenizer: str, vocab_size: int, tok=None, log: Log = print, batch_docs: int = 256
) -> np.ndarray:
    """The flat token array: bytes as they are, or BPE ids with <|endoftext|> after each doc."""
    if tokenizer == "bytes":
        return np.frombuffer(b"".join(docs), dtype=np.uint8).astype(np.uint16)
    if tok is None:
        raise ValueError("tokenize_corpus: tokenizer=bpe needs tok=")
    eot = tok.token_to_id(EOT_TOKEN)
    chunks: list[np.ndarray] = []
    t0, last = time.perf_counter(), time.perf_counter()
    for start in range(0, len(docs), batch_docs):
        texts = [d.decode("utf-8", errors="replace") for d in docs[start : start + batch_docs]]
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            chunks.append(np.asarray(enc.ids + [eot], dtype=np.int64))
        if time.perf_counter() - last > 5.0:
            last = time.perf_counter()
            log(
                f"data: tokenised {min(start + batch_docs, len(docs))}/{len(docs)} documents "
                f"({time.perf_counter() - t0:.0f} s)"
            )
    flat = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    if flat.size and int(flat.max()) >= vocab_size:
        raise DataError(
            f"tokenizer produced id {int(flat.max())} >= model.vocab_size "
            f"({vocab_size}); delete the tokenizer cache or raise model.vocab_size"
        )
    return flat.astype(dtype_for_vocab(vocab_size))


def corpus_tokens(cfg: JobConfig, log: Log, max_bytes: int | None) -> tuple[np.ndarray, TokenizerFiles]:
    """The token cache of source=stdlib/files (built once per host), and where its tokenizer is."""
    d, vocab = cfg.data, cfg.model.vocab_size
    if max_bytes is None:
        max_bytes = STDLIB_MAX_BYTES if d.source == "stdlib" else 0
    parts = _capped(corpus_files(d.source, d.paths), max_bytes)
    total = sum(n for _, n in parts)
    cache = Path(d.cache_dir).expanduser()
    tok_path = cache / "tokenizers" / f"{_corpus_key(parts, 'bpe', vocab)}.json"
    spec, ident = hf_spec(d, vocab) if d.tokenizer == "hf" else (None, None)
    data_key = _corpus_key(parts, d.tokenizer, vocab, *([ident] if ident else []))
    token_path = cache / "tokens" / f"{data_key}.npy"
    # bpe: tokens whose tokenizer file is gone are rebuilt with it
    has_tokenizer = tok_path.is_file if d.tokenizer == "bpe" else None

    def build() -> None:
        t0 = time.perf_counter()
        log(f"data: reading {len(parts)} {d.source} files ({total / 1e6:.1f} MB)")
        docs = read_corpus(parts)
        if spec is not None:
            batches = (
                [x.decode("utf-8", errors="replace") for x in docs[i : i + BATCH_DOCS]]
                for i in range(0, len(docs), BATCH_DOCS)
            )
            n = write_token_npy(
                token_path,
                tokenize_texts(batches, spec, vocab_size=vocab, num_docs=len(docs), num_proc=d.num_proc, log=log),
                dtype_for_vocab(vocab),
            )
        else:
            tok = load_or_train_bpe(docs, vocab_size=vocab, path=tok_path, log=log) if d.tokenizer == "bpe" else None
            flat = tokenize_corpus(docs, tokenizer=d.tokenizer, vocab_size=vocab, tok=tok, log=log)
            atomic_write(token_path, lambda fh: np.save(fh, flat, allow_pickle=False))
            n = len(flat)
        log(f"data: {n} tokens cached in {time.perf_counter() - t0:.1f} s -> {token_path}")

    built = build_once(token_path, build, log=log, also=has_tokenizer)
    tokens = load_token_cache(token_path)
    if not built:
        log(f"data: {len(parts)} {d.source} files, {total / 1e6:.1f} MB, {len(tokens)} tokens (cached {token_path})")
    return tokens, _files(d.tokenizer, tok_path, spec.path if spec is not None else None)


def _files(kind: str, bpe_path: Path, hf_path: str | None) -> TokenizerFiles:
    if kind == "bpe":
        return TokenizerFiles("bpe", str(bpe_path.resolve()))
    return TokenizerFiles(kind, hf_path)
