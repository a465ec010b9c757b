"""Training data: corpus discovery, byte and BPE tokenizers with caches, windows, the
deterministic global-batch sampler and the per-pipeline split of a global batch."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from oobleck_elastic.config import load_config
from oobleck_elastic.data import tokenizer as tokenizer_mod
from oobleck_elastic.data.errors import DataError
from oobleck_elastic.data.sampler import GlobalBatchSampler, collate, pipeline_slices
from oobleck_elastic.data.dataset import TokenWindows, build_dataset
from oobleck_elastic.data.corpus import corpus_files

SMALL = 200_000  # corpus cap for the tests (bytes)


def cfg(tmp_path: Path, *overrides: str):
    return load_config("configs/gpt2-tiny.yaml", [f"data.cache_dir={tmp_path / 'cache'}", *overrides])


def quiet(_: str) -> None:
    pass


# --------------------------------------------------------------------- corpus


def test_stdlib_corpus_found_sorted_and_filtered():
    files = corpus_files("stdlib")
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    banned = {"test", "tests", "idlelib", "lib2to3", "site-packages"}
    assert not any(banned.intersection(r.split("/")[:-1]) for r in rel)
    assert "os.py" in rel and files == corpus_files("stdlib")


def test_stdlib_dataset_deterministic(tmp_path):
    a = build_dataset(cfg(tmp_path), log=quiet, max_bytes=SMALL)
    b = build_dataset(cfg(tmp_path / "other"), log=quiet, max_bytes=SMALL)
    assert len(a.tokens) == SMALL and np.array_equal(a.tokens, b.tokens)
    assert len(a) == (SMALL - 1) // 64


def test_bytes_tokens_round_trip(tmp_path):
    ds = build_dataset(cfg(tmp_path), log=quiet, max_bytes=SMALL)
    assert ds.tokens.dtype == np.uint16
    raw = b"".join(Path(f).read_bytes() for f in corpus_files("stdlib"))[:SMALL]
    assert np.asarray(ds.tokens).astype(np.uint8).tobytes() == raw
    assert not list((tmp_path / "cache").rglob(".*tmp*"))  # atomic writes leave no temp files


def test_bytes_needs_vocab_256(tmp_path):
    with pytest.raises(DataError, match=r"model.vocab_size \(100\) is below 256"):
        build_dataset(cfg(tmp_path, "model.vocab_size=100"), log=quiet, max_bytes=SMALL)


def test_bpe_trains_caches_and_stays_in_vocab(tmp_path, monkeypatch):
    c = cfg(tmp_path, "data.tokenizer=bpe", "model.vocab_size=512")
    lines: list[str] = []
    ds = build_dataset(c, log=lines.append, max_bytes=SMALL)
    assert any("training a byte-level BPE" in line for line in lines)
    assert ds.tokens.dtype == np.uint16 and int(ds.tokens.max()) < 512
    assert len(ds.tokens) < SMALL / 1.5  # merges compress the bytes
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*.json"))) == 1

    def boom(*_a, **_k):
        raise AssertionError("retrained although the tokenizer is cached")

    monkeypatch.setattr(tokenizer_mod, "_train_bpe", boom)
    for token_file in (tmp_path / "cache" / "tokens").glob("*.npy"):
        token_file.unlink()  # force re-tokenising: the tokenizer must come from the cache
    again = build_dataset(c, log=quiet, max_bytes=SMALL)
    assert np.array_equal(ds.tokens, again.tokens)


def test_bpe_vocab_too_small(tmp_path):
    with pytest.raises(DataError, match="too small for data.tokenizer=bpe"):
        build_dataset(cfg(tmp_path, "data.tokenizer=bpe", "model.vocab_size=256"), log=quiet, max_bytes=SMALL)


def test_files_source(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "b.txt").write_text("bravo " * 50)
    (docs / "sub" / "a.txt").write_text("alpha " * 50)
    (docs / ".hidden").write_text("hidden")
    (docs / "blob.bin").write_bytes(b"\0\1\2" * 10)
    single = tmp_path / "z.md"
    single.write_text("zulu " * 40)
    c = cfg(tmp_path, "data.source=files", f"data.paths=[{docs},{single}]", "data.seq_len=16")
    assert corpus_files("files", c.data.paths) == sorted(
        [(docs / "b.txt").resolve(), (docs / "sub" / "a.txt").resolve(), single.resolve()]
    )
    ds = build_dataset(c, log=quiet)
    expected = b"".join(p.read_bytes() for p in corpus_files("files", c.data.paths))
    assert np.asarray(ds.tokens).astype(np.uint8).tobytes() == expected
    assert len(ds) == (len(expected) - 1) // 16


def test_files_missing_path_message(tmp_path):
    missing = tmp_path / "nope.txt"
    c = cfg(tmp_path, "data.source=files", f"data.paths=[{missing}]")
    with pytest.raises(DataError) as err:
        build_dataset(c, log=quiet)
    assert str(err.value) == (f"data.paths entry '{missing}' does not exist: fix the path or remove it from data.paths")


def test_files_empty_corpus(tmp_path):
    (tmp_path / "empty").mkdir()
    c = cfg(tmp_path, "data.source=files", f"data.paths=[{tmp_path / 'empty'}]")
    with pytest.raises(DataError, match="contain no non-empty text files"):
        build_dataset(c, log=quiet)


# --------------------------------------------------------------------- windows


def test_windows_labels_are_next_tokens():
    tokens = np.arange(1000, dtype=np.uint16) % 251
    ds = TokenWindows(tokens, 8)
    assert len(ds) == (1000 - 1) // 8
    for i in (0, 1, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
        assert torch.equal(x, torch.from_numpy(tokens[i * 8 : i * 8 + 8].astype(np.int64)))
        assert torch.equal(y[:-1], x[1:]) and int(y[-1]) == int(tokens[i * 8 + 8])
    with pytest.raises(IndexError):
        ds[len(ds)]
    xs, ys = collate(ds, [3, 0, 5])
    assert xs.shape == ys.shape == (3, 8)
    assert torch.equal(xs[1], ds[0][0]) and torch.equal(ys[2], ds[5][1])


# --------------------------------------------------------------------- sampler


def test_sampler_deterministic_disjoint_and_rollover():
    n, gbs = 103, 10  # 10 steps per epoch, 3 samples dropped per epoch
    a, b = GlobalBatchSampler(n, gbs, seed=7), GlobalBatchSampler(n, gbs, seed=7)
    for step in (0, 3, 9, 10, 25, 3):  # out of order on purpose
        assert a.indices(step) == GlobalBatchSampler(n, gbs, seed=7).indices(step)
        assert a.indices(step) == b.indices(step)
    epoch0 = [i for s in range(10) for i in a.indices(s)]
    epoch1 = [i for s in range(10, 20) for i in a.indices(s)]
    assert all(len(a.indices(s)) == gbs for s in range(30))
    assert len(set(epoch0)) == len(epoch0) == 100 and len(set(epoch1)) == 100
    assert set(epoch0) <= set(range(n)) and epoch0 != epoch1  # a new permutation per epoch
    assert a.indices(0) != GlobalBatchSampler(n, gbs, seed=8).indices(0)
    with pytest.raises(DataError, match="fewer than one global batch"):
        GlobalBatchSampler(5, 10, seed=0)


def test_pipeline_slices_cover_in_order():
    slices = pipeline_slices([3, 1, 4], 2)
    assert slices == [(0, 6), (6, 8), (8, 16)]
    batch = GlobalBatchSampler(100, 16, seed=1).indices(4)
    parts = [batch[s:e] for s, e in slices]
    assert [i for p in parts for i in p] == batch
    assert pipeline_slices([], 2) == []
