"""Training data: an offline text corpus, a tokenizer, a cached token file and per-step batches.

Mechanism, in the order the data flows (steps 1-3 for the built-in corpora; `data.source=jsonl|parquet|
hf_disk` text datasets, the `hf` tokenizer and pre-tokenized `tokens` files come from `sources`, whose
docstring explains them, and then go through the same steps 4-6):

1. **Corpus** (`corpus_files`). `data.source=stdlib` uses the CPython standard library's own
   `.py` files (found with `sysconfig.get_paths()["stdlib"]`, so every machine with the same
   Python patch version has the same corpus) minus the `test`/`tests`/`idlelib`/`lib2to3`/
   `site-packages` trees; `data.source=files` uses the files and directories in `data.paths`
   (directories recursively, hidden entries and binary files skipped). Files are sorted by path
   and read in that order; `max_bytes` caps the corpus (whole files are kept while they fit,
   the last one is cut) so tests and demos stay fast. Each file is one document.
2. **Tokenizer**. `bytes`: token = byte (vocab 256, no training). `bpe`: a byte-level BPE
   trained with the `tokenizers` package on the corpus to `model.vocab_size` tokens (one
   `<|endoftext|>` special token closes every document), saved as one JSON file in
   `<cache_dir>/tokenizers/<key>.json` and reused when present. The key hashes the corpus file
   list, their sizes, the byte cap and the vocab size.
3. **Token cache**. The tokenised corpus is one flat numpy array (uint16, or uint32 for a vocab
   over 65536) in `<cache_dir>/tokens/<key>.npy`, memory-mapped when read. Every cache file is
   written to a temporary name in the same directory, fsynced and renamed, so no reader ever sees
   a partial file, and built under an flock of `<key>.npy.lock` (`sources.build_once`): of the
   workers of a host that start together, one tokenises and the others wait for its file.
4. **Samples** (`TokenWindows`). Sample i is the window `tokens[i*L : i*L + L + 1]`; its input
   is the first L tokens and its labels the last L (the next token at every position).
5. **Batches**. `GlobalBatchSampler.indices(step)` is the global batch of one optimizer step, a
   function of (seed, step) alone: epoch e is a permutation drawn from a generator seeded with
   `stable_seed(seed, "data-epoch", e)`, the incomplete tail of every epoch is dropped and step s
   takes the s-th consecutive block of `global_batch_size` samples. A job that re-plans (or
   resumes from a checkpoint) at step s therefore continues with exactly the samples it would
   have seen. `pipeline_slices` splits that global batch between the pipelines of a plan in
   proportion to their microbatches, contiguously and in pipeline order.
6. **Prefetch** (`BatchPrefetcher`). While step s runs, a background thread collates the batch
   of step s+1 (pinned when CUDA is available); `get(step)` uses it only when it was made for
   the same step and the same indices (the caller's `indices_of`, which follows the plan), so it
   always returns `collate(dataset, indices_of(step))`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from ..config import JobConfig
from ..models.build import stable_seed
from .sources import (
    BATCH_DOCS,
    EOT_TOKEN,
    TEXT_SOURCES,
    DataError,
    TokenFiles,
    TokenizerSpec,
    build_once,
    files_key,
    iter_text_batches,
    load_hf_tokenizer,
    load_text_dataset,
    load_token_cache,
    open_token_files,
    text_source_files,
    tokenize_texts,
    tokenizer_fingerprint,
    write_token_npy,
)
from .sources import atomic_write as _atomic_write

__all__ = [
    "DataError",
    "STDLIB_MAX_BYTES",
    "STDLIB_EXCLUDE",
    "EOT_TOKEN",
    "corpus_files",
    "read_corpus",
    "load_or_train_bpe",
    "tokenize_corpus",
    "TokenWindows",
    "build_dataset",
    "GlobalBatchSampler",
    "pipeline_slices",
    "collate",
    "BatchPrefetcher",
]

STDLIB_MAX_BYTES = 8 * 1024 * 1024
"""Default corpus cap for source=stdlib (the whole stdlib is ~12 MB)."""
STDLIB_EXCLUDE = frozenset(
    {"test", "tests", "idlelib", "idle_test", "lib2to3", "site-packages", "dist-packages", "__pycache__"}
)
"""Directory names skipped when collecting the stdlib corpus."""

Log = Callable[[str], None]

# ----------------------------------------------------------------------------- corpus


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


# ----------------------------------------------------------------------------- tokenizers


def _train_bpe(texts: list[str], vocab_size: int):  # -> tokenizers.Tokenizer
    """Train a byte-level BPE (the slow part; tests monkeypatch it to check the cache)."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT_TOKEN], show_progress=False
    )
    return tok._tokenizer


def load_or_train_bpe(docs: Sequence[bytes], *, vocab_size: int, path: Path, log: Log = print):
    """The BPE tokenizer cached at `path`, trained on `docs` first when the file is missing."""
    from tokenizers import Tokenizer

    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception
            raise DataError(f"tokenizer cache '{path}' is unreadable ({err}); delete it to retrain") from None
    if vocab_size <= 256:
        raise DataError(
            f"model.vocab_size ({vocab_size}) is too small for data.tokenizer=bpe: "
            "a byte-level BPE needs 256 byte tokens plus merges and <|endoftext|>; "
            "raise model.vocab_size (e.g. 4096) or use data.tokenizer=bytes"
        )
    t0 = time.perf_counter()
    log(f"data: training a byte-level BPE tokenizer (vocab {vocab_size}) on {sum(map(len, docs)) / 1e6:.1f} MB")
    tok = _train_bpe([d.decode("utf-8", errors="replace") for d in docs], vocab_size)
    blob = tok.to_str().encode()
    _atomic_write(path, lambda fh: fh.write(blob))
    log(f"data: tokenizer trained in {time.perf_counter() - t0:.1f} s ({tok.get_vocab_size()} tokens) -> {path}")
    return tok


def _dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= 65536 else np.uint32


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
    return flat.astype(_dtype(vocab_size))


# ----------------------------------------------------------------------------- dataset


class TokenWindows(torch.utils.data.Dataset):
    """Fixed windows over a flat token array: item i = (input_ids, labels), labels = next tokens."""

    def __init__(
        self, tokens: np.ndarray | TokenFiles, seq_len: int, *, vocab_size: int | None = None, source: str | None = None
    ) -> None:
        if seq_len < 1:
            raise DataError(f"data.seq_len must be >= 1 (got {seq_len})")
        self.tokens, self.seq_len = tokens, int(seq_len)
        self.vocab_size, self.source = vocab_size, source
        self._n = max(0, (len(tokens) - 1) // self.seq_len)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = int(i)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"sample {i} is out of range: the dataset has {self._n} windows")
        start = i * self.seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]

    def __repr__(self) -> str:
        return (
            f"TokenWindows({self._n} windows of {self.seq_len} tokens, {len(self.tokens)} tokens, source={self.source})"
        )


def _hf_spec(d: Any, vocab: int) -> tuple[TokenizerSpec, str]:
    """The spec of data.tokenizer=hf (loaded and checked against model.vocab_size) and its identity."""
    _, eot = load_hf_tokenizer(d.tokenizer_path, vocab)
    path = str(Path(d.tokenizer_path).expanduser().resolve())
    return TokenizerSpec("hf", path, eot), f"hf:{tokenizer_fingerprint(path)}"


def _corpus_tokens(cfg: JobConfig, log: Log, max_bytes: int | None) -> np.ndarray:
    """The token cache of source=stdlib/files (built once per host)."""
    d, vocab = cfg.data, cfg.model.vocab_size
    if max_bytes is None:
        max_bytes = STDLIB_MAX_BYTES if d.source == "stdlib" else 0
    parts = _capped(corpus_files(d.source, d.paths), max_bytes)
    total = sum(n for _, n in parts)
    cache = Path(d.cache_dir).expanduser()
    tok_path = cache / "tokenizers" / f"{_corpus_key(parts, 'bpe', vocab)}.json"
    spec, ident = _hf_spec(d, vocab) if d.tokenizer == "hf" else (None, None)
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
                _dtype(vocab),
            )
        else:
            tok = load_or_train_bpe(docs, vocab_size=vocab, path=tok_path, log=log) if d.tokenizer == "bpe" else None
            flat = tokenize_corpus(docs, tokenizer=d.tokenizer, vocab_size=vocab, tok=tok, log=log)
            _atomic_write(token_path, lambda fh: np.save(fh, flat, allow_pickle=False))
            n = len(flat)
        log(f"data: {n} tokens cached in {time.perf_counter() - t0:.1f} s -> {token_path}")

    built = build_once(token_path, build, log=log, also=has_tokenizer)
    tokens = load_token_cache(token_path)
    if not built:
        log(f"data: {len(parts)} {d.source} files, {total / 1e6:.1f} MB, {len(tokens)} tokens (cached {token_path})")
    return tokens


def _text_source_tokens(cfg: JobConfig, log: Log) -> np.ndarray:
    """The token cache of source=jsonl/parquet/hf_disk (built once per host)."""
    d, vocab = cfg.data, cfg.model.vocab_size
    cache = Path(d.cache_dir).expanduser()
    files = text_source_files(d.source, d.paths)
    tok_path = cache / "tokenizers" / f"{files_key(files, d.source, d.text_field, 'bpe', vocab)}.json"
    if d.tokenizer == "hf":
        spec, ident = _hf_spec(d, vocab)
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
        n = write_token_npy(token_path, chunks, _dtype(vocab))
        log(f"data: {n} tokens cached in {time.perf_counter() - t0:.1f} s -> {token_path}")

    built = build_once(token_path, build, log=log, also=has_tokenizer)
    tokens = load_token_cache(token_path)
    if not built:
        log(f"data: {len(files)} {d.source} files, {len(tokens)} tokens (cached {token_path})")
    return tokens


def build_dataset(cfg: JobConfig, *, log: Log = print, max_bytes: int | None = None) -> TokenWindows:
    """The training windows of a job, building (or reusing) the tokenizer and token caches.

    `max_bytes` caps the corpus of source=stdlib/files; None = `STDLIB_MAX_BYTES` for
    source=stdlib and no cap for source=files; 0 = no cap. Other sources are read whole.
    source=tokens uses the ids of its files as they are: data.tokenizer is not used.
    """
    d, vocab = cfg.data, cfg.model.vocab_size
    if d.source == "tokens":
        if d.tokenizer != "bytes":
            log(f"data: data.source=tokens uses the token ids as they are (data.tokenizer={d.tokenizer} is unused)")
        tokens = open_token_files(d.paths, d.token_dtype, vocab)
        log(f"data: {len(tokens)} tokens memory-mapped from {len(getattr(tokens, 'files', [0]))} token file(s)")
    else:
        if d.tokenizer not in ("bytes", "bpe", "hf"):
            raise DataError(f"data.tokenizer is '{d.tokenizer}'; choose bytes, bpe or hf")
        if d.tokenizer == "bytes" and vocab < 256:
            raise DataError(
                f"model.vocab_size ({vocab}) is below 256 but data.tokenizer=bytes "
                "needs one token per byte value: set model.vocab_size=256 (or more)"
            )
        if d.source in TEXT_SOURCES:
            tokens = _text_source_tokens(cfg, log)
        else:
            tokens = _corpus_tokens(cfg, log, max_bytes)
    ds = TokenWindows(tokens, d.seq_len, vocab_size=vocab, source=d.source)
    if len(ds) == 0:
        raise DataError(
            f"the corpus has {len(tokens)} tokens, fewer than one window of "
            f"data.seq_len+1 = {d.seq_len + 1}: add data or lower data.seq_len"
        )
    return ds


# ----------------------------------------------------------------------------- batches


class GlobalBatchSampler:
    """The global batch of every optimizer step, a function of (seed, step) only."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        if global_batch_size < 1:
            raise DataError(f"training.global_batch_size must be >= 1 (got {global_batch_size})")
        if num_samples < global_batch_size:
            raise DataError(
                f"the dataset has {num_samples} samples, fewer than one global batch "
                f"(training.global_batch_size={global_batch_size}): add data "
                "(data.paths), lower data.seq_len or lower training.global_batch_size"
            )
        self.num_samples, self.global_batch_size, self.seed = num_samples, global_batch_size, seed
        self.steps_per_epoch = num_samples // global_batch_size
        self._cached: tuple[int, torch.Tensor] | None = None

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of one epoch."""
        if self._cached is None or self._cached[0] != epoch:
            gen = torch.Generator().manual_seed(stable_seed(self.seed, "data-epoch", epoch))
            self._cached = (epoch, torch.randperm(self.num_samples, generator=gen))
        return self._cached[1]

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def indices(self, step: int) -> list[int]:
        """Sample indices of the global batch of optimizer step `step` (0-based)."""
        if step < 0:
            raise ValueError(f"step must be >= 0 (got {step})")
        epoch, block = divmod(step, self.steps_per_epoch)
        start = block * self.global_batch_size
        return self.epoch_permutation(epoch)[start : start + self.global_batch_size].tolist()


def pipeline_slices(plan_microbatches: Sequence[int], microbatch_size: int) -> list[tuple[int, int]]:
    """Each pipeline's contiguous [start, end) share of the global batch, in pipeline order.

    Pipeline p gets microbatch_size * b_p samples starting at microbatch_size * sum(b_q, q < p).
    """
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1 (got {microbatch_size})")
    bad = [b for b in plan_microbatches if b < 0]
    if bad:
        raise ValueError(f"microbatch counts must be >= 0 (got {list(plan_microbatches)})")
    out, cursor = [], 0
    for b in plan_microbatches:
        out.append((cursor, cursor + microbatch_size * int(b)))
        cursor += microbatch_size * int(b)
    return out


def collate(dataset: TokenWindows, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples into (input_ids [n, seq_len], labels [n, seq_len]) int64 tensors."""
    pairs = [dataset[i] for i in indices]
    if not pairs:
        empty = torch.zeros(0, dataset.seq_len, dtype=torch.int64)
        return empty, empty.clone()
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


class BatchPrefetcher:
    """Collates the batch of step s+1 in a background thread while step s runs.

    `indices_of(step)` (the samples this worker takes at `step` under the current plan) is called
    on the caller's thread; the thread only collates (and pins). `get(step)` returns the prepared
    batch when it was made for this step and these indices, else builds it at once; either way the
    result is `collate(dataset, indices_of(step))`. Call `reset()` when the plan changes to drop a
    prepared batch early; an exception raised while preparing surfaces from the `get` that uses it.
    """

    def __init__(
        self, dataset: TokenWindows, indices_of: Callable[[int], Sequence[int]], *, pin_memory: bool = False
    ) -> None:
        self.dataset, self.indices_of = dataset, indices_of
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.hits = self.misses = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prefetch")
        self._next: Optional[tuple[int, list[int], Future]] = None

    def _build(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = collate(self.dataset, indices)
        return (x.pin_memory(), y.pin_memory()) if self.pin_memory else (x, y)

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of `step`; then starts preparing step + 1."""
        indices = [int(i) for i in self.indices_of(step)]
        pending, self._next = self._next, None
        if pending is not None and pending[0] == step and pending[1] == indices:
            batch = pending[2].result()
            self.hits += 1
        else:
            batch = self._build(indices)
            self.misses += 1
        try:
            upcoming = [int(i) for i in self.indices_of(step + 1)]
        except Exception:  # noqa: BLE001 - no next step (yet): get(step + 1) will say why
            return batch
        self._next = (step + 1, upcoming, self._pool.submit(self._build, upcoming))
        return batch

    def reset(self) -> None:
        """Drop the prepared batch (the plan changed)."""
        self._next = None

    def close(self) -> None:
        self._next = None
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "BatchPrefetcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
