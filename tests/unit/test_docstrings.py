"""Module docstrings stay short: what the module is, the invariant it owns, the docs page with the story.

The mechanism's prose belongs in docs/, a line's reason in a comment at that line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("oobleck_elastic", "launcher")
MAX_LINES = 12


def docstring_lines(source: str) -> int:
    """How many lines the module's docstring spans (0: none)."""
    doc = ast.get_docstring(ast.parse(source), clean=False)
    return len(doc.splitlines()) if doc else 0


def too_long(root: Path) -> list[str]:
    """'module: N lines' for each module under `root` whose docstring is over MAX_LINES."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            n = docstring_lines(path.read_text())
            if n > MAX_LINES:
                found.append(f"{name}: {n} lines")
    return found


def test_module_docstrings_are_short() -> None:
    long = too_long(ROOT)
    assert not long, f"module docstrings over {MAX_LINES} lines (move the story to docs/):\n  " + "\n  ".join(long)


def test_the_check_names_a_long_docstring(tmp_path: Path) -> None:
    (tmp_path / "oobleck_elastic").mkdir()
    (tmp_path / "launcher").mkdir()
    essay = '"""' + "\n".join(f"line {i}" for i in range(MAX_LINES + 1)) + '"""\n'
    (tmp_path / "oobleck_elastic" / "long.py").write_text(essay)
    (tmp_path / "oobleck_elastic" / "short.py").write_text('"""One line."""\n')
    (tmp_path / "launcher" / "none.py").write_text("x = 1\n")
    assert too_long(tmp_path) == [f"oobleck_elastic/long.py: {MAX_LINES + 1} lines"]
