"""The tokenizer of an export (`oobleck export`): which one, its special token ids, its files.

An exported directory is self-contained: beside config.json and the weights it holds the
tokenizer the model was trained with. The story: docs/training.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

__all__ = [
    "END_OF_TEXT",
    "TOKENIZER_DIR",
    "SpecialTokens",
    "TokenizerSource",
    "byte_tokenizer",
    "choose_tokenizer",
    "end_of_text",
    "has_tokenizer_files",
    "load_tokenizer",
    "special_tokens",
]

END_OF_TEXT = "<|endoftext|>"
"""The end-of-text token of a job's BPE (and of a pretrained tokenizer without an eos_token)."""

TOKENIZER_DIR = "tokenizer"
"""The directory of a step directory that holds the copy of the job's tokenizer."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class SpecialTokens:
    """The special token ids a model config names (None: the tokenizer has no such token)."""

    bos: Optional[int]
    eos: Optional[int]
    pad: Optional[int]


@dataclass(frozen=True)
class TokenizerSource:
    """The tokenizer an export writes: `kind` bytes, bpe (a `tokenizers` JSON file), hf (a
    save_pretrained directory) or none; `origin` says where it came from, for the log."""

    kind: str
    path: Optional[Path]
    origin: str


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


def byte_tokenizer() -> Any:
    """data.tokenizer=bytes as a `transformers` fast tokenizer: id b is byte b (docs/training.md)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def end_of_text(tok: Any) -> Optional[str]:
    """The token the data pipeline puts after every document: eos_token, else `<|endoftext|>`
    when the vocabulary has it, else None."""
    if tok.eos_token:
        return str(tok.eos_token)
    return END_OF_TEXT if END_OF_TEXT in tok.get_vocab() else None


def special_tokens(tok: Any) -> SpecialTokens:
    """bos/eos/pad ids of a `transformers` tokenizer (docs/training.md); eos is `end_of_text`'s id."""
    eos = end_of_text(tok)
    return SpecialTokens(
        bos=tok.bos_token_id,
        eos=None if eos is None else int(tok.convert_tokens_to_ids(eos)),
        pad=tok.pad_token_id,
    )


def choose_tokenizer(
    option: Optional[str],
    record: Any,
    *,
    data_source: str,
    data_tokenizer: str,
    tokenizer_path: Optional[str],
    pretrained_path: Optional[str],
    pretrained_has_tokenizer: bool,
    step_dir: Path,
) -> TokenizerSource:
    """Which tokenizer an export writes (docs/training.md); raises ValueError when it cannot know."""
    if option is not None:
        if option == "none":
            return TokenizerSource("none", None, "--tokenizer none")
        p = Path(option).expanduser()
        return TokenizerSource("hf" if p.is_dir() else "bpe", p, f"--tokenizer {option}")
    if record is not None:
        ok = isinstance(record, Mapping) and record.get("kind") in ("bpe", "hf") and isinstance(record.get("path"), str)
        if not ok or ".." in Path(record["path"]).parts or Path(record["path"]).is_absolute():
            raise ValueError(
                f"checkpoint {step_dir}: extra.tokenizer {record!r} in its manifest is not "
                '{"kind": "bpe"|"hf", "path": <inside the step directory>}: pass --tokenizer PATH'
            )
        return TokenizerSource(record["kind"], step_dir / record["path"], f"the job's tokenizer ({record['kind']})")
    if data_source == "tokens":
        if pretrained_path and pretrained_has_tokenizer:
            return TokenizerSource("hf", Path(pretrained_path).expanduser(), "model.pretrained_path")
        return TokenizerSource("none", None, "data.source=tokens, which records no tokenizer")
    if data_tokenizer == "bytes":
        return TokenizerSource("bytes", None, "data.tokenizer=bytes")
    if data_tokenizer == "hf" and tokenizer_path:
        return TokenizerSource("hf", Path(tokenizer_path).expanduser(), "data.tokenizer_path")
    raise ValueError(
        f"checkpoint {step_dir} holds no copy of its data.tokenizer={data_tokenizer} tokenizer (it was saved "
        "before checkpoints carried one): pass --tokenizer FILE (the job's <data.cache_dir>/tokenizers/*.json) "
        "or --tokenizer none"
    )


def has_tokenizer_files(path: Optional[str]) -> bool:
    """Whether directory `path` holds a saved tokenizer (tokenizer.json, tokenizer_config.json, ...)."""
    return bool(path) and any((Path(str(path)).expanduser() / f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(source: TokenizerSource, vocab_size: int) -> Optional[Any]:
    """The `transformers` tokenizer of `source` (None for kind none), its eos_token set to the
    end-of-text training used; refused when it has more tokens than the embedding has rows."""
    if source.kind == "none":
        return None
    if source.kind == "bytes":
        tok = byte_tokenizer()
    elif source.path is None or not source.path.exists():
        raise ValueError(
            f"tokenizer '{source.path}' ({source.origin}) does not exist: pass --tokenizer PATH (a tokenizers "
            "JSON file or a save_pretrained directory) or --tokenizer none"
        )
    elif source.kind == "bpe":
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        try:
            raw = Tokenizer.from_file(str(source.path))
        except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception
            raise ValueError(
                f"tokenizer '{source.path}' ({source.origin}) is not a tokenizers JSON file ({err})"
            ) from None
        eot = END_OF_TEXT if raw.token_to_id(END_OF_TEXT) is not None else None
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=eot, eos_token=eot)
    else:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(source.path), local_files_only=True)
        except Exception as err:  # noqa: BLE001 - transformers raises many kinds
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"tokenizer '{source.path}' ({source.origin}) could not be loaded ({first})") from None
        if not tok.eos_token and end_of_text(tok):
            tok.eos_token = end_of_text(tok)
    if len(tok) > vocab_size:
        raise ValueError(
            f"tokenizer '{source.path or source.kind}' ({source.origin}) has {len(tok)} tokens but the model's "
            f"embedding has {vocab_size} rows: it is not the tokenizer this checkpoint was trained with; "
            "pass --tokenizer PATH"
        )
    return tok
