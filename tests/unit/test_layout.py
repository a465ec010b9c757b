"""The front door and the manual stay true to the tree.

CONTRIBUTING.md's "Repository layout" section holds one fenced block, a tree: each line is
indentation (two spaces a level), one name or a comma-separated group of names, then two or more
spaces and what they hold. A name ending in "/" is a directory and the lines indented under it
are inside it. The checks:

- every package (a directory with `__init__.py`) and every module under `oobleck_elastic/`, and
  the top-level folders launcher/, examples/, configs/, bench/, tests/ and docs/, is named (a
  package's `__init__.py` is named by its directory's line);
- every path the layout names exists, as a directory when it ends in "/", as a file otherwise;
- README.md stays a front door: at most `README_MAX_LINES` lines;
- every relative link in README.md, CONTRIBUTING.md and docs/*.md resolves: the file or folder
  exists, and a `#anchor` is the GitHub slug of one of the target page's headings.
- every test those pages cite as `tests/<lane>/test_x.py::test_name` exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "oobleck_elastic"
TOP_LEVEL = ("launcher/", "examples/", "configs/", "bench/", "tests/", "docs/")
NAME = re.compile(r"[A-Za-z0-9_.\-]+/?")
LAYOUT_PAGE = "CONTRIBUTING.md"
README_MAX_LINES = 250


def layout_block(page: str) -> list[tuple[int, str]]:
    """The lines of the first fenced block under the page's "## Repository layout" heading, with
    their line numbers (blank lines left out)."""
    lines = page.splitlines()
    heading = next((i for i, line in enumerate(lines) if re.fullmatch(r"## Repository layout\b.*", line)), None)
    if heading is None:
        raise AssertionError(f'{LAYOUT_PAGE} has no "## Repository layout" section')
    fences = []
    for i in range(heading + 1, len(lines)):
        if lines[i].startswith("## "):
            break
        if lines[i].startswith("```"):
            fences.append(i)
            if len(fences) == 2:
                return [(n + 1, lines[n]) for n in range(fences[0] + 1, fences[1]) if lines[n].strip()]
    raise AssertionError(f'{LAYOUT_PAGE}\'s "## Repository layout" section has no fenced block (the tree)')


def named_paths(lines: list[tuple[int, str]]) -> dict[str, int]:
    """Every path the tree names, relative to the repository root, with its line in the page."""
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
                raise AssertionError(
                    f"{LAYOUT_PAGE} line {number} {line.strip()!r}: {name!r} is not a file or folder name"
                )
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
    return named_paths(layout_block((ROOT / LAYOUT_PAGE).read_text(encoding="utf-8")))


def test_the_layout_names_every_package_and_module(layout: dict[str, int]) -> None:
    missing = [path for path in tree_paths() if path not in layout]
    assert not missing, (
        f"{LAYOUT_PAGE}'s layout does not name these (add a line for each, or a group):\n  " + "\n  ".join(missing)
    )


def test_every_path_the_layout_names_exists(layout: dict[str, int]) -> None:
    stale = []
    for path, line in layout.items():
        target = ROOT / path
        if path.endswith("/") and not target.is_dir():
            stale.append(f"{path} ({LAYOUT_PAGE} line {line}: no such folder)")
        elif not path.endswith("/") and not target.is_file():
            stale.append(f"{path} ({LAYOUT_PAGE} line {line}: no such file)")
    assert not stale, f"{LAYOUT_PAGE}'s layout names paths that do not exist:\n  " + "\n  ".join(stale)


def test_the_layout_parser_reads_groups_and_nesting() -> None:
    tree = [
        "oobleck_elastic/              the package",
        "  cli.py, cluster_ops.py      two modules on one line",
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


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into a page of docs/ and link it"
    )


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped (hyphens and
    underscores kept), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's slug in a markdown page, numbered as GitHub numbers repeats (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            slug = github_slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """The relative link targets of a markdown page, outside code blocks and code spans."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.\-]*:", t)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file or folder")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: {resolved.name} has no heading with the anchor #{anchor}")
    return broken


@pytest.mark.parametrize(
    "page",
    ["README.md", "CONTRIBUTING.md", "tests/README.md"]
    + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
)
def test_every_relative_link_resolves(page: str) -> None:
    broken = broken_links(ROOT / page)
    assert not broken, f"{page} has broken links:\n  " + "\n  ".join(broken)


def test_github_slugs() -> None:
    assert (
        github_slug("`oobleck goodput`: where the job's wall time went")
        == "oobleck-goodput-where-the-jobs-wall-time-went"
    )
    assert github_slug("`oobleck samples --check`: every sample exactly once") == (
        "oobleck-samples---check-every-sample-exactly-once"
    )
    assert github_slug("Gray failures: a step that is not finite, or whose loss spikes") == (
        "gray-failures-a-step-that-is-not-finite-or-whose-loss-spikes"
    )
    assert github_slug("Training (`examples/train.py`)") == "training-examplestrainpy"


def test_every_cited_test_exists() -> None:
    """A guarantee that names its test (`tests/<lane>/test_x.py::test_name`, or `::test_name` after a
    file already named) names one that exists."""
    missing = []
    for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"(tests/[\w/]+\.py)?::(\w+)", text):
            if match.group(1):
                current = match.group(1)
            else:  # `::name` cites the last file named before it on the page
                before = re.findall(r"tests/[\w/]+\.py", text[: match.start()])
                current = before[-1] if before else ""
            source = ROOT / current
            if not source.is_file() or not re.search(rf"^def {match.group(2)}\b", source.read_text(), re.MULTILINE):
                missing.append(f"{page.relative_to(ROOT)}: {current}::{match.group(2)}")
    assert not missing, "cited tests that do not exist:\n  " + "\n  ".join(missing)
