"""Data users bring: JSONL / Parquet / save_to_disk text datasets, a pretrained tokenizer directory,
pre-tokenized .bin / .npy files, the once-per-host token cache, one-line errors, the exactly-once
sample order over every source, the batch prefetcher and a short training run on a JSONL dataset.
Everything is written in the test (nothing is downloaded)."""

from __future__ import annotations

import json
import math
import multiprocessing
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from oobleck_elastic.config import ConfigError, load_config
from oobleck_elastic.data import text as text_mod
from oobleck_elastic.data.sampler import BatchPrefetcher, GlobalBatchSampler, collate
from oobleck_elastic.data.errors import DataError
from oobleck_elastic.data.dataset import TokenWindows, build_dataset
from oobleck_elastic.data.tokens import TokenFiles

pytestmark = pytest.mark.core  # fast: make test runs it at every landing (tests/lanes.py)

ROOT = Path(__file__).resolve().parents[2]
EOT = "<|endoftext|>"
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) + "." for _ in range(n)]


DOCS = make_docs(80)


def quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE (vocab 300) saved as a transformers tokenizer directory, eos = <|endoftext|>."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        make_docs(200, seed=1), vocab_size=300, min_frequency=2, special_tokens=[EOT], show_progress=False
    )
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOT).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def hf_tok(tokdir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokdir), local_files_only=True)


def expected_ids(tok, docs: list[str]) -> np.ndarray:
    eot = tok.convert_tokens_to_ids(EOT)
    return np.array([i for d in docs for i in tok(d, add_special_tokens=False)["input_ids"] + [eot]], np.int64)


def cfg(tmp_path: Path, *overrides: str):
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=320", "data.seq_len=8", *overrides],
    )


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path)
    return path


def write_hf_disk(path: Path, docs: list[str]) -> Path:
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"id": list(range(len(docs))), "text": docs}).save_to_disk(str(path))
    return path


def hf(tokdir: Path) -> list[str]:
    return ["data.tokenizer=hf", f"data.tokenizer_path={tokdir}"]


# --------------------------------------------------------------------- text datasets


def test_jsonl_hf_tokens_are_docs_joined_by_eot(tmp_path, tokdir, hf_tok):
    two = ["alpha bravo charlie.", "zulu yankee xray whiskey victor."]
    f = write_jsonl(tmp_path / "two.jsonl", two)
    ds = build_dataset(
        cfg(tmp_path, "data.source=jsonl", f"data.paths=[{f}]", "data.seq_len=4", *hf(tokdir)), log=quiet
    )
    d1, d2 = (hf_tok(t, add_special_tokens=False)["input_ids"] for t in two)
    eot = hf_tok.convert_tokens_to_ids(EOT)
    assert np.asarray(ds.tokens).tolist() == d1 + [eot] + d2 + [eot]
    assert ds.tokens.dtype == np.uint16 and isinstance(ds, TokenWindows)


def test_parquet_hf_disk_and_directories_match_jsonl(tmp_path, tokdir, hf_tok):
    expected = expected_ids(hf_tok, DOCS)
    shards = tmp_path / "shards"  # a directory: shards read in sorted order
    write_jsonl(shards / "b.jsonl", DOCS[40:])
    write_jsonl(shards / "a.jsonl", DOCS[:40])
    write_parquet(tmp_path / "pq" / "00.parquet", DOCS[:30])
    write_parquet(tmp_path / "pq" / "01.parquet", DOCS[30:])
    for source, path in (
        ("jsonl", shards),
        ("parquet", tmp_path / "pq"),
        ("hf_disk", write_hf_disk(tmp_path / "disk", DOCS)),
    ):
        ds = build_dataset(cfg(tmp_path, f"data.source={source}", f"data.paths=[{path}]", *hf(tokdir)), log=quiet)
        assert np.array_equal(np.asarray(ds.tokens), expected), source


def test_bytes_and_bpe_tokenizers_on_jsonl(tmp_path):
    f = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    ds = build_dataset(cfg(tmp_path, "data.source=jsonl", f"data.paths=[{f}]", "model.vocab_size=256"), log=quiet)
    assert np.asarray(ds.tokens).astype(np.uint8).tobytes() == "".join(DOCS).encode()  # no separator
    lines: list[str] = []
    bpe = build_dataset(
        cfg(tmp_path, "data.source=jsonl", f"data.paths=[{f}]", "data.tokenizer=bpe", "model.vocab_size=400"),
        log=lines.append,
    )
    assert any("training a byte-level BPE" in line for line in lines)
    from tokenizers import Tokenizer

    (tok_file,) = (tmp_path / "cache" / "tokenizers").glob("*.json")
    tok = Tokenizer.from_file(str(tok_file))
    eot = tok.token_to_id(EOT)
    want = [i for d in DOCS for i in tok.encode(d, add_special_tokens=False).ids + [eot]]
    assert np.asarray(bpe.tokens).tolist() == want and int(bpe.tokens.max()) < 400


def test_files_source_with_hf_tokenizer(tmp_path, tokdir, hf_tok):
    for i, doc in enumerate(DOCS[:10]):
        (tmp_path / "docs" / f"{i:02d}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(doc)
    ds = build_dataset(cfg(tmp_path, "data.source=files", f"data.paths=[{tmp_path / 'docs'}]", *hf(tokdir)), log=quiet)
    assert np.array_equal(np.asarray(ds.tokens), expected_ids(hf_tok, DOCS[:10]))


def test_cache_reused_and_rebuilt_when_the_file_changes(tmp_path, tokdir, monkeypatch):
    f = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    c = cfg(tmp_path, "data.source=jsonl", f"data.paths=[{f}]", *hf(tokdir))
    first: list[str] = []
    a = build_dataset(c, log=first.append)
    assert sum("data: tokenising 80 documents" in line for line in first) == 1

    def boom(*_a, **_k):
        raise AssertionError("tokenised again although the tokens are cached")

    monkeypatch.setattr(text_mod, "tokenize_texts", boom)
    again: list[str] = []
    b = build_dataset(c, log=again.append)
    assert np.array_equal(a.tokens, b.tokens) and any("(cached" in line for line in again)
    assert isinstance(b.tokens, np.memmap)
    monkeypatch.undo()
    write_jsonl(f, DOCS[:50])  # new size and mtime: a new cache entry
    changed: list[str] = []
    c2 = build_dataset(c, log=changed.append)
    assert any("tokenising 50 documents" in line for line in changed) and len(c2.tokens) < len(a.tokens)
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 2
    assert not list((tmp_path / "cache").rglob(".*tmp*"))


def test_progress_lines_and_num_proc(tmp_path, tokdir, hf_tok, monkeypatch):
    from oobleck_elastic.data import tokenizer

    monkeypatch.setattr(tokenizer, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(text_mod, "BATCH_DOCS", 30)
    f = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    lines: list[str] = []
    ds = build_dataset(
        cfg(tmp_path, "data.source=jsonl", f"data.paths=[{f}]", "data.num_proc=2", *hf(tokdir)), log=lines.append
    )
    assert [line.split(" (")[0] for line in lines if "tokenised" in line] == [
        "data: tokenised 30/80 documents",
        "data: tokenised 60/80 documents",
        "data: tokenised 80/80 documents",
    ]
    assert np.array_equal(np.asarray(ds.tokens), expected_ids(hf_tok, DOCS))


def _build_in_child(c, barrier, queue) -> None:
    lines: list[str] = []
    barrier.wait()
    ds = build_dataset(c, log=lines.append)
    queue.put((lines, np.asarray(ds.tokens).tolist()))


def test_three_processes_tokenise_once(tmp_path, tokdir, monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    slow = text_mod.tokenize_texts

    def slow_tokenize(*a, **k):  # hold the lock long enough for the others to queue on it
        import time

        time.sleep(1.0)
        yield from slow(*a, **k)

    monkeypatch.setattr(text_mod, "tokenize_texts", slow_tokenize)
    f = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    c = cfg(tmp_path, "data.source=jsonl", f"data.paths=[{f}]", *hf(tokdir))
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(c, barrier, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    lines = [line for r in results for line in r[0]]
    assert sum("data: tokenising" in line for line in lines) == 1, lines
    assert sum("(cached" in line for line in lines) == 2, lines
    assert results[0][1] == results[1][1] == results[2][1]


# --------------------------------------------------------------------- token files


def test_token_files_memory_mapped_and_concatenated(tmp_path):
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 320, 1000, dtype=np.uint16), rng.integers(0, 320, 777, dtype=np.uint16)
    a.tofile(tmp_path / "a.bin")
    np.save(tmp_path / "b.npy", b)
    one = build_dataset(cfg(tmp_path, "data.source=tokens", f"data.paths=[{tmp_path / 'a.bin'}]"), log=quiet)
    assert isinstance(one.tokens, np.memmap) and np.array_equal(one.tokens, a)
    npy = build_dataset(cfg(tmp_path, "data.source=tokens", f"data.paths=[{tmp_path / 'b.npy'}]"), log=quiet)
    assert isinstance(npy.tokens, np.memmap) and np.array_equal(npy.tokens, b)
    both = build_dataset(
        cfg(
            tmp_path,
            "data.source=tokens",
            f"data.paths=[{tmp_path / 'a.bin'},{tmp_path / 'b.npy'}]",
            "data.tokenizer=bpe",
        ),
        log=quiet,
    )
    assert isinstance(both.tokens, TokenFiles) and all(isinstance(x, np.memmap) for x in both.tokens.arrays)
    ref = TokenWindows(np.concatenate([a, b]), 8)
    assert len(both) == len(ref) == (1777 - 1) // 8
    for i in (0, 124, 125, len(ref) - 1):  # window 124 spans the two files
        assert torch.equal(both[i][0], ref[i][0]) and torch.equal(both[i][1], ref[i][1])
    assert int(both.tokens[1000]) == int(b[0]) and int(both.tokens[-1]) == int(b[-1])
    assert not (tmp_path / "cache").exists()  # token files are used as they are: no cache

    big = rng.integers(0, 70_000, 100, dtype=np.uint32)
    big.tofile(tmp_path / "big.bin")
    wide = build_dataset(
        cfg(
            tmp_path,
            "data.source=tokens",
            f"data.paths=[{tmp_path / 'big.bin'}]",
            "data.token_dtype=uint32",
            "model.vocab_size=70000",
        ),
        log=quiet,
    )
    assert np.array_equal(wide.tokens, big)


def test_exactly_once_order_is_the_same_over_every_source(tmp_path, tokdir, hf_tok):
    ids = expected_ids(hf_tok, DOCS).astype(np.uint16)
    ids[:500].tofile(tmp_path / "part0.bin")
    np.save(tmp_path / "part1.npy", ids[500:])
    ids.tofile(tmp_path / "all.bin")
    sources = {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", DOCS),
        "parquet": write_parquet(tmp_path / "d.parquet", DOCS),
        "hf_disk": write_hf_disk(tmp_path / "disk", DOCS),
    }
    built = {
        s: build_dataset(cfg(tmp_path, f"data.source={s}", f"data.paths=[{p}]", *hf(tokdir)), log=quiet)
        for s, p in sources.items()
    }
    built["tokens.bin"] = build_dataset(
        cfg(tmp_path, "data.source=tokens", f"data.paths=[{tmp_path / 'all.bin'}]"), log=quiet
    )
    built["tokens.bin+npy"] = build_dataset(
        cfg(tmp_path, "data.source=tokens", f"data.paths=[{tmp_path / 'part0.bin'},{tmp_path / 'part1.npy'}]"),
        log=quiet,
    )
    ref = TokenWindows(ids, 8)
    gbs = 8
    for name, ds in built.items():
        sampler = GlobalBatchSampler(len(ds), gbs, seed=3)
        assert len(ds) == len(ref), name
        for step in range(6):
            x, y = collate(ds, sampler.indices(step))
            rx, ry = collate(ref, GlobalBatchSampler(len(ref), gbs, seed=3).indices(step))
            assert torch.equal(x, rx) and torch.equal(y, ry), (name, step)
        epoch = [i for s in range(sampler.steps_per_epoch) for i in sampler.indices(s)]
        assert len(epoch) == len(set(epoch)) == sampler.steps_per_epoch * gbs, name  # no window twice


# --------------------------------------------------------------------- errors


def _error(tmp_path, *overrides: str) -> str:
    with pytest.raises(DataError) as err:
        build_dataset(cfg(tmp_path, *overrides), log=quiet)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_text_source_errors(tmp_path, tokdir, hf_tok):
    f = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    assert _error(tmp_path, "data.source=jsonl", f"data.paths=[{f}]", "data.text_field=body") == (
        f"data.text_field 'body' is not a column of {f}: columns are id, text"
    )
    p = write_parquet(tmp_path / "docs.parquet", DOCS)
    assert _error(tmp_path, "data.source=parquet", f"data.paths=[{p}]", "data.text_field=body") == (
        f"data.text_field 'body' is not a column of {p}: columns are id, text"
    )
    disk = write_hf_disk(tmp_path / "disk", DOCS)
    assert _error(tmp_path, "data.source=hf_disk", f"data.paths=[{disk}]", "data.text_field=body") == (
        f"data.text_field 'body' is not a column of {disk}: columns are id, text"
    )
    assert _error(tmp_path, "data.source=hf_disk", f"data.paths=[{disk}]", "data.text_field=id") == (
        f"data.text_field 'id' of {disk} holds Value('int64') values, not text: choose a text column "
        "(columns are id, text)"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _error(tmp_path, "data.source=jsonl", f"data.paths=[{empty}]") == (
        f"data.paths file '{empty}' is empty: remove it from data.paths"
    )
    junk = tmp_path / "junk.jsonl"
    junk.write_text("this is not json\n")
    assert _error(tmp_path, "data.source=jsonl", f"data.paths=[{junk}]").startswith(
        f"data.paths file '{junk}' is not JSON lines ("
    )
    bad_pq = tmp_path / "bad.parquet"
    bad_pq.write_bytes(b"PAR1 not really")
    assert _error(tmp_path, "data.source=parquet", f"data.paths=[{bad_pq}]").startswith(
        f"data.paths file '{bad_pq}' is not a readable Parquet file ("
    )
    (tmp_path / "nothing").mkdir()
    assert _error(tmp_path, "data.source=parquet", f"data.paths=[{tmp_path / 'nothing'}]") == (
        f"data.paths entry '{tmp_path / 'nothing'}' has no non-empty *.parquet files for data.source=parquet"
    )


def test_tokenizer_errors(tmp_path, tokdir, hf_tok):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    f = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    src = ["data.source=jsonl", f"data.paths=[{f}]"]
    n = len(hf_tok)
    assert _error(tmp_path, *src, *hf(tokdir), "model.vocab_size=256") == (
        f"data.tokenizer_path '{tokdir}' has {n} tokens but model.vocab_size is 256: set model.vocab_size >= {n}"
    )
    assert _error(tmp_path, *src, "data.tokenizer=hf", f"data.tokenizer_path={tmp_path / 'none'}") == (
        f"data.tokenizer_path '{tmp_path / 'none'}' does not exist: give the directory of a tokenizer saved "
        "with save_pretrained, or a tokenizers JSON file (Tokenizer.save)"
    )
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(DOCS, vocab_size=270, show_progress=False)
    no_eos = tmp_path / "no-eos"
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer).save_pretrained(str(no_eos))
    assert _error(tmp_path, *src, *hf(no_eos)) == (
        f"data.tokenizer_path '{no_eos}' has no end-of-text token (no eos_token and no <|endoftext|>): save the "
        "tokenizer with an eos_token"
    )


def test_a_tokenizers_json_file_is_a_tokenizer_path(tmp_path):
    """data.tokenizer_path may be the file `Tokenizer.save` writes: documents are encoded by it,
    each followed by <|endoftext|>; its errors name the file and what to change."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        make_docs(200, seed=1), vocab_size=300, min_frequency=2, special_tokens=[EOT], show_progress=False
    )
    tok_file = tmp_path / "tok.json"
    bpe.save(str(tok_file))
    two = ["alpha bravo charlie.", "zulu yankee xray whiskey victor."]
    f = write_jsonl(tmp_path / "two.jsonl", two)
    src = ["data.source=jsonl", f"data.paths=[{f}]", "data.seq_len=4"]
    ds = build_dataset(cfg(tmp_path, *src, *hf(tok_file)), log=quiet)
    eot = bpe.token_to_id(EOT)
    d1, d2 = (bpe.encode(t).ids for t in two)
    assert np.asarray(ds.tokens).tolist() == d1 + [eot] + d2 + [eot]
    assert _error(tmp_path, *src, *hf(tok_file), "model.vocab_size=256") == (
        f"data.tokenizer_path '{tok_file}' has 300 tokens but model.vocab_size is 256: set model.vocab_size >= 300"
    )
    no_eot = ByteLevelBPETokenizer()
    no_eot.train_from_iterator(DOCS, vocab_size=270, show_progress=False)
    no_eot.save(str(tmp_path / "no-eot.json"))
    assert _error(tmp_path, *src, *hf(tmp_path / "no-eot.json")) == (
        f"data.tokenizer_path '{tmp_path / 'no-eot.json'}' has no <|endoftext|> token: train it with "
        "special_tokens=['<|endoftext|>']"
    )
    (tmp_path / "junk.json").write_text("{}")
    assert _error(tmp_path, *src, *hf(tmp_path / "junk.json")).startswith(
        f"data.tokenizer_path '{tmp_path / 'junk.json'}' is not a tokenizers JSON file ("
    )


def test_token_file_errors(tmp_path):
    small = tmp_path / "small.bin"
    np.arange(300, dtype=np.uint16).tofile(small)
    assert _error(tmp_path, "data.source=tokens", f"data.paths=[{small}]", "model.vocab_size=70000") == (
        f"token file '{small}' is read as data.token_dtype=uint16 (ids up to 65535) but model.vocab_size is 70000: "
        "write the files as uint32 and set data.token_dtype=uint32"
    )
    npy = tmp_path / "small.npy"
    np.save(npy, np.arange(300, dtype=np.uint16))
    assert _error(tmp_path, "data.source=tokens", f"data.paths=[{npy}]", "model.vocab_size=70000") == (
        f"token file '{npy}' holds uint16 ids (at most 65535) but model.vocab_size is 70000: save it as uint32"
    )
    assert _error(tmp_path, "data.source=tokens", f"data.paths=[{small}]", "model.vocab_size=256") == (
        f"token file '{small}' has token id 299 >= model.vocab_size (256) in its first 300 tokens: raise "
        "model.vocab_size or check data.token_dtype"
    )
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\1\0\2")
    assert _error(tmp_path, "data.source=tokens", f"data.paths=[{odd}]") == (
        f"token file '{odd}' has 3 bytes, not a multiple of 2 (data.token_dtype=uint16): check data.token_dtype"
    )
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert _error(tmp_path, "data.source=tokens", f"data.paths=[{empty}]") == (
        f"token file '{empty}' is empty: remove it from data.paths"
    )
    txt = tmp_path / "x.txt"
    txt.write_text("hi")
    assert _error(tmp_path, "data.source=tokens", f"data.paths=[{txt}]").startswith(
        f"token file '{txt}' is neither .bin nor .npy"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.tokenizer=hf"],
            "'data.tokenizer' is hf but 'data.tokenizer_path' is not set: give the directory of a "
            "tokenizer saved with save_pretrained",
        ),
        (["data.source=jsonl"], "'data.source' is jsonl but 'data.paths' is empty"),
        (
            ["data.source=hf_disk", "data.paths=[a,b]"],
            "'data.source' is hf_disk but 'data.paths' has 2 entries: give the "
            "one directory written by Dataset.save_to_disk",
        ),
        (
            ["data.tokenizer_path=tok"],
            "'data.tokenizer_path' is set but 'data.tokenizer' is bytes: set data.tokenizer=hf to use it",
        ),
        (["data.num_proc=0"], "'data.num_proc' must be >= 1 (got 0)"),
        (["data.token_dtype=int8"], "'data.token_dtype' is 'int8'; choose one of uint16, uint32"),
        (
            ["data.seq_len=128"],
            "'data.seq_len' (128) exceeds 'model.max_seq_len' (64): lower data.seq_len or raise model.max_seq_len",
        ),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value) == f"<defaults>: {message}"


# --------------------------------------------------------------------- prefetch


def test_prefetcher_returns_collate_of_indices_of_step():
    ds = TokenWindows(np.arange(2000, dtype=np.uint16) % 251, 8)
    sampler = GlobalBatchSampler(len(ds), 6, seed=1)
    plan = {"slice": (0, 6)}

    def indices_of(step: int) -> list[int]:
        lo, hi = plan["slice"]
        return sampler.indices(step)[lo:hi]

    with BatchPrefetcher(ds, indices_of, pin_memory=True) as pf:
        for step in range(4):
            x, y = pf.get(step)
            rx, ry = collate(ds, indices_of(step))
            assert torch.equal(x, rx) and torch.equal(y, ry)
        assert pf.hits == 3 and pf.misses == 1
        plan["slice"] = (2, 4)  # the plan changed without reset: the prepared batch is not used
        assert torch.equal(pf.get(4)[0], collate(ds, indices_of(4))[0]) and pf.misses == 2
        pf.reset()
        assert torch.equal(pf.get(5)[1], collate(ds, indices_of(5))[1]) and pf.misses == 3
        assert torch.equal(pf.get(9)[0], collate(ds, indices_of(9))[0])  # a jump: built at once
        assert torch.equal(pf.get(10)[0], collate(ds, indices_of(10))[0]) and pf.hits == 4


def test_prefetcher_thread_exception_surfaces_on_get():
    ds = TokenWindows(np.arange(100, dtype=np.uint16), 8)
    pf = BatchPrefetcher(ds, lambda step: [0, 1] if step == 0 else [0, 10_000])
    pf.get(0)
    with pytest.raises(IndexError, match="sample 10000 is out of range"):
        pf.get(1)
    pf.close()


# --------------------------------------------------------------------- end to end


def test_train_two_steps_on_jsonl_with_hf_tokenizer(tmp_path, tokdir):
    from oobleck_elastic.engine.run import train

    f = write_jsonl(tmp_path / "docs.jsonl", make_docs(60, seed=5))
    c = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "training.steps=2",
            "data.seq_len=32",
            "training.global_batch_size=4",
            "training.microbatch_size=2",
            "model.vocab_size=320",
            "data.source=jsonl",
            f"data.paths=[{f}]",
            *hf(tokdir),
            f"data.cache_dir={tmp_path / 'cache'}",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"logging.tensorboard_dir={tmp_path / 'runs'}",
        ],
    )
    summary = train(c)
    assert summary.final_step == 2 and math.isfinite(summary.first_loss) and math.isfinite(summary.last_loss)


@pytest.mark.extended  # the default run covers this ground (CONTRIBUTING.md, "Extended tests")
@pytest.mark.slow
def test_a_node_failure_on_jsonl_text_keeps_the_exactly_once_order(tmp_path, tokdir, etcd_server, run_id):
    """Four torchrun nodes train on a JSONL dataset through a pretrained tokenizer; one node is
    SIGKILLed: the survivors re-plan and finish with the single-process reference's weights, so
    every step saw exactly the samples it would have seen without the failure."""
    from helpers import assert_same, run_job, tiny_profile

    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in make_docs(600, seed=3)))
    profile = tiny_profile(tmp_path / "profile.json")
    extra = [
        "data.source=jsonl",
        f"data.paths=[{data}]",
        "data.tokenizer=hf",
        f"data.tokenizer_path={tokdir}",
        "model.vocab_size=320",
    ]
    out, job, ref = run_job(tmp_path, etcd_server, run_id, ["--nodes", "4", "--kill", "1@3"], 8, profile, extra=extra)
    assert "entered from generation 1" in out, out[-3000:]
    assert out.count("data: tokenising") == 1, out[-3000:]  # the four workers share one host's cache
    assert_same(job, ref)
