"""Tokenizers as a picklable `TokenizerSpec`, and encoding documents in order, in parallel.

Worker processes load their own copy from the spec; a tokenizer's fingerprint is part of the
token cache's key, and a checkpoint keeps the tokenizer's files so an export writes the one the
job trained with. The story: docs/training.md.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from dataclasses import dataclass

import numpy as np

from ..models.export_tokenizer import END_OF_TEXT, TOKENIZER_DIR, end_of_text
from .cache import Log
from .errors import DataError
from .cache import atomic_write

__all__ = [
    "load_or_train_bpe",
    "EOT_TOKEN",
    "BATCH_DOCS",
    "PROGRESS_EVERY_S",
    "TokenizerSpec",
    "TokenizerFiles",
    "save_tokenizer_files",
    "hf_spec",
    "load_hf_tokenizer",
    "load_tokenizer_file",
    "tokenize_texts",
    "tokenizer_fingerprint",
]


PROGRESS_EVERY_S = 5.0
"""Seconds between two 'data: tokenised i/n documents' lines."""


BATCH_DOCS = 1000
"""Documents per tokenizer call (and per task of a worker process)."""


EOT_TOKEN = END_OF_TEXT
"""The end-of-text token BPE appends to every document (and hf uses when it has no eos_token)."""


def load_tokenizer_file(path: str, vocab_size: int) -> tuple[Any, int]:
    """(tokenizers.Tokenizer, id of `<|endoftext|>`) of the `tokenizers` JSON file `path`, checked
    against model.vocab_size."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(Path(path).expanduser()))
    except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(
            f"data.tokenizer_path '{path}' is not a tokenizers JSON file ({first}): save one with "
            "Tokenizer.save('tok.json'), or give a directory saved with save_pretrained"
        ) from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise DataError(
            f"data.tokenizer_path '{path}' has {size} tokens but model.vocab_size is "
            f"{vocab_size}: set model.vocab_size >= {size}"
        )
    eot = tok.token_to_id(EOT_TOKEN)
    if eot is None:
        raise DataError(
            f"data.tokenizer_path '{path}' has no {EOT_TOKEN} token: train it with special_tokens=['{EOT_TOKEN}']"
        )
    return tok, eot


def check_tokenizer_path(path: Optional[str]) -> None:
    """Raise DataError unless `path` (data.tokenizer_path) is set and is a directory (saved with
    save_pretrained) or a file (a `tokenizers` JSON)."""
    if not path:
        raise DataError(
            "data.tokenizer is hf but data.tokenizer_path is not set: give the directory of a "
            "tokenizer saved with save_pretrained"
        )
    p = Path(path).expanduser()
    if not p.is_file() and not p.is_dir():
        raise DataError(
            f"data.tokenizer_path '{path}' does not exist: give the directory of a tokenizer saved "
            "with save_pretrained, or a tokenizers JSON file (Tokenizer.save)"
        )


def load_hf_tokenizer(path: Optional[str], vocab_size: int) -> tuple[Any, int]:
    """(tokenizer, end-of-text id) of the saved tokenizer in `path` (a save_pretrained directory,
    or a `tokenizers` JSON file: `load_tokenizer_file`), checked against model.vocab_size."""
    check_tokenizer_path(path)
    assert path is not None
    p = Path(path).expanduser()
    if p.is_file():
        return load_tokenizer_file(path, vocab_size)
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
    eos = end_of_text(tok)
    if eos is None:
        raise DataError(
            f"data.tokenizer_path '{path}' has no end-of-text token (no eos_token and no "
            f"{EOT_TOKEN}): save the tokenizer with an eos_token"
        )
    eos_id = tok.convert_tokens_to_ids(eos)
    assert isinstance(eos_id, int), eos_id
    return tok, eos_id


_TOKENIZER_FILES = {"vocab.json", "merges.txt", "vocab.txt", "special_tokens_map.json", "added_tokens.json"}


def _is_tokenizer_file(f: Path) -> bool:
    return f.is_file() and (
        f.name.startswith("tokenizer") or f.name in _TOKENIZER_FILES or f.suffix in (".model", ".tiktoken")
    )


def tokenizer_fingerprint(path: str) -> str:
    """A hash of the tokenizer files in `path` (tokenizer*, vocab, merges, *.model; not the weights)."""
    h = hashlib.sha256()
    root = Path(path).expanduser()
    for f in sorted(root.iterdir()):
        if _is_tokenizer_file(f):
            h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class TokenizerFiles:
    """Where the tokenizer a job's tokens came from lives: `kind` bytes (no file), bpe (`path`: the
    cached tokenizers JSON) or hf (`path`: the save_pretrained directory)."""

    kind: str
    path: Optional[str] = None


_ALSO_COPIED = ("config.json", "chat_template.jinja")
"""Besides the tokenizer files: what AutoTokenizer may read to pick the class, the chat template."""


def save_tokenizer_files(files: TokenizerFiles, step_dir: Path) -> Optional[dict[str, str]]:
    """Copy the job's tokenizer into `<step_dir>/tokenizer/` (before the manifest is written) and
    return the manifest's `extra.tokenizer` record; None for bytes (the config says it all)."""
    if files.kind not in ("bpe", "hf"):
        return None
    src = Path(str(files.path)).expanduser()
    dest = step_dir / TOKENIZER_DIR
    dest.mkdir(parents=True, exist_ok=True)
    if files.kind == "hf" and src.is_file():  # a `tokenizers` JSON (Tokenizer.save): kept as a BPE is
        shutil.copyfile(src, dest / "bpe.json")
        return {"kind": "bpe", "path": f"{TOKENIZER_DIR}/bpe.json"}
    if files.kind == "bpe":
        if not src.is_file():
            raise DataError(f"the job's tokenizer {src} is gone (data.cache_dir was cleaned?): not copied")
        shutil.copyfile(src, dest / "bpe.json")
        return {"kind": "bpe", "path": f"{TOKENIZER_DIR}/bpe.json"}
    if not src.is_dir():
        raise DataError(f"data.tokenizer_path {src} is gone: the tokenizer is not copied")
    for f in sorted(src.iterdir()):
        if _is_tokenizer_file(f) or (f.is_file() and f.name in _ALSO_COPIED):
            shutil.copyfile(f, dest / f.name)
    return {"kind": "hf", "path": TOKENIZER_DIR}


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


def hf_spec(d: Any, vocab: int) -> tuple[TokenizerSpec, str]:
    """The spec of data.tokenizer=hf (loaded and checked against model.vocab_size) and its identity
    (a hash of its files: part of the token cache's key)."""
    _, eot = load_hf_tokenizer(d.tokenizer_path, vocab)
    path = Path(d.tokenizer_path).expanduser().resolve()
    if path.is_file():  # a tokenizers JSON file
        return TokenizerSpec("bpe", str(path), eot), f"file:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"
    return TokenizerSpec("hf", str(path), eot), f"hf:{tokenizer_fingerprint(str(path))}"


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
    atomic_write(path, lambda fh: fh.write(blob))
    log(f"data: tokenizer trained in {time.perf_counter() - t0:.1f} s ({tok.get_vocab_size()} tokens) -> {path}")
    return tok
