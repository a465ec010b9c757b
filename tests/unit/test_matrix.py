"""The feature matrix's cover (tests/matrix.py): every pair of two features' values that the job
accepts together is in some pairwise row, no row is refused, and the full matrix is the product
less the refused combinations."""

from __future__ import annotations

import itertools

from matrix import FEATURES, FULL, PAIRWISE, covering_array, name, pairs, product, refusal


def test_every_accepted_pair_is_in_a_pairwise_row() -> None:
    covered = set().union(*(pairs(r) for r in PAIRWISE))
    for a, b in itertools.combinations(FEATURES, 2):
        for va, vb in itertools.product(FEATURES[a], FEATURES[b]):
            accepted = any(refusal(r) is None for r in product(FEATURES) if r[a] == va and r[b] == vb)
            assert ((a, va, b, vb) in covered) == accepted, (a, va, b, vb)


def test_no_row_is_refused_and_each_is_named_once() -> None:
    assert all(refusal(r) is None for r in PAIRWISE + FULL)
    assert len({name(r) for r in FULL}) == len(FULL) == 4 * 4 * 2 * 2 * 2 * 2 - 4 * 4 * 2 * 2  # less shadows x tp2
    assert {name(r) for r in PAIRWISE} <= {name(r) for r in FULL}
    assert 16 <= len(PAIRWISE) <= 24  # the two 4-valued features need 16 rows at least


def test_the_refusal_is_shadows_with_tensor_parallelism_only() -> None:
    refused = [r for r in product(FEATURES) if refusal(r) is not None]
    assert refused and all(r["shadows"] > 0 and r["tp"] > 1 for r in refused)


def test_a_cover_of_made_up_features() -> None:
    rows = covering_array({"a": (0, 1, 2), "b": (0, 1, 2), "c": (0, 1)})
    assert len(rows) == 9 and {(r["a"], r["b"]) for r in rows} == set(itertools.product((0, 1, 2), repeat=2))
    assert {(r["a"], r["c"]) for r in rows} == set(itertools.product((0, 1, 2), (0, 1)))
    assert covering_array({"a": (0, 1)}, allowed=lambda r: r["a"] == 1) == []  # no pairs to cover
    two = covering_array({"a": (0, 1), "b": (0, 1)}, allowed=lambda r: (r["a"], r["b"]) != (1, 1))
    assert sorted((r["a"], r["b"]) for r in two) == [(0, 0), (0, 1), (1, 0)]
