"""README.md's "Layout" section matches the tree.

The section holds one fenced block, a tree: each line is indentation (two spaces a level), one
name or a comma-separated group of names, then two or more spaces and what they hold. A name
ending in "/" is a directory and the lines indented under it are inside it. The checks:

- every package (a directory with `__init__.py`) and every module under `oobleck_elastic/`, and
  the top-level folders launcher/, examples/, configs/, bench/, tests/ and docs/, is named (a
  package's `__init__.py` is named by its directory's line);
- every path the Layout names exists, as a directory when it ends in "/", as a file otherwise.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "oobleck_elastic"
TOP_LEVEL = ("launcher/", "examples/", "configs/", "bench/", "tests/", "docs/")
NAME = re.compile(r"[A-Za-z0-9_.\-]+/?")


def layout_block(readme: str) -> list[tuple[int, str]]:
    """The lines of the first fenced block under the README's "## Layout" heading, with their
    line numbers in README.md (blank lines left out)."""
    lines = readme.splitlines()
    heading = next((i for i, line in enumerate(lines) if re.fullmatch(r"## Layout\b.*", line)), None)
    if heading is None:
        raise AssertionError('README.md has no "## Layout" section')
    fences = []
    for i in range(heading + 1, len(lines)):
        if lines[i].startswith("## "):
            break
        if lines[i].startswith("```"):
            fences.append(i)
            if len(fences) == 2:
                return [(n + 1, lines[n]) for n in range(fences[0] + 1, fences[1]) if lines[n].strip()]
    raise AssertionError('README.md\'s "## Layout" section has no fenced block (the tree)')


def named_paths(lines: list[tuple[int, str]]) -> dict[str, int]:
    """Every path the tree names, relative to the repository root, with its line in README.md."""
    named: dict[str, int] = {}
    parents: list[tuple[int, str]] = []  # (indent, directory path ending in "/")
    for number, line in lines:
        indent = len(line) - len(line.lstrip(" "))
        names = re.split(r" {2,}", line.strip(), maxsplit=1)[0]
        while parents and parents[-1][0] >= indent:
            parents.pop()
        base = parents[-1][1] if parents else ""
        directories = []
        for name in (n.strip() for n in names.split(",")):
            if not NAME.fullmatch(name):
                raise AssertionError(f"README.md line {number} {line.strip()!r}: {name!r} is not a file or folder name")
            named[base + name] = number
            if name.endswith("/"):
                directories.append(base + name)
        if len(directories) == 1:
            parents.append((indent, directories[0]))
    return named


def tree_paths() -> list[str]:
    """Every package directory and module under the package, and the top-level folders."""
    found = list(TOP_LEVEL)
    for init in sorted((ROOT / PACKAGE).rglob("__init__.py")):
        package = init.parent
        found.append(package.relative_to(ROOT).as_posix() + "/")
        found += [m.relative_to(ROOT).as_posix() for m in sorted(package.glob("*.py")) if m.name != "__init__.py"]
    return found


@pytest.fixture(scope="module")
def layout() -> dict[str, int]:
    return named_paths(layout_block((ROOT / "README.md").read_text(encoding="utf-8")))


def test_the_layout_names_every_package_and_module(layout: dict[str, int]) -> None:
    missing = [path for path in tree_paths() if path not in layout]
    assert not missing, (
        "README.md's Layout section does not name these (add a line for each, or a group):\n  " + "\n  ".join(missing)
    )


def test_every_path_the_layout_names_exists(layout: dict[str, int]) -> None:
    stale = []
    for path, line in layout.items():
        target = ROOT / path
        if path.endswith("/") and not target.is_dir():
            stale.append(f"{path} (README.md line {line}: no such folder)")
        elif not path.endswith("/") and not target.is_file():
            stale.append(f"{path} (README.md line {line}: no such file)")
    assert not stale, "README.md's Layout section names paths that do not exist:\n  " + "\n  ".join(stale)


def test_the_layout_parser_reads_groups_and_nesting() -> None:
    tree = [
        "oobleck_elastic/              the package",
        "  cli.py, cluster_ops.py            two modules on one line",
        "  etcd/                       a package",
        "    client.py                 inside it",
        "  logs.py                     back at the package root",
        "docs/                         a top-level folder",
    ]
    lines = list(enumerate(tree, 1))
    assert set(named_paths(lines)) == {
        "oobleck_elastic/",
        "oobleck_elastic/cli.py",
        "oobleck_elastic/cluster_ops.py",
        "oobleck_elastic/etcd/",
        "oobleck_elastic/etcd/client.py",
        "oobleck_elastic/logs.py",
        "docs/",
    }
    with pytest.raises(AssertionError, match="is not a file or folder name"):
        named_paths([(1, "oobleck_elastic/ the package with one space")])
