"""The unit lane: pure, in-process: no etcd, no process group of several ranks, no job. Every test here
gets the lane's marker and time cap (tests/lanes.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lanes import mark_lane


@pytest.hookimpl(tryfirst=True)  # before -m filters by the lane's marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_lane(items, Path(__file__).resolve().parent, "unit")
