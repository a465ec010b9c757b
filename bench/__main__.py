"""`python -m bench`: the list of benches; `python -m bench NAME [--quick] [ARGS...]`: run one
(`--quick`: its short form; ARGS go to the bench, `python -m bench NAME --help` lists them)."""

from __future__ import annotations

import ast
import importlib
import sys
from typing import Optional

from bench import BENCHES
from bench.harness import ROOT, Bench, run


def summary(name: str) -> str:
    """The first line of a bench's docstring, read without importing it (torch is slow to import)."""
    doc = ast.get_docstring(ast.parse((ROOT / "bench" / f"{name}.py").read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split())


def load(name: str) -> Bench:
    entry = importlib.import_module(f"bench.{name}").BENCH
    if not isinstance(entry, Bench):
        raise SystemExit(f"bench.{name}.BENCH is not a harness.Bench")
    return entry


def main(argv: Optional[list[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "--list"):
        print("usage: python -m bench NAME [--quick] [ARGS...]\n")
        for name in BENCHES:
            print(f"  {name:<14} {summary(name)}")
        return 0
    name, rest = args[0], args[1:]
    if name not in BENCHES:
        print(f"no bench {name!r}; the benches: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    quick = "--quick" in rest
    if quick:
        rest.remove("--quick")
    prog, sys.argv[0] = sys.argv[0], f"python -m bench {name}"  # what the bench's --help shows
    try:
        result = run(name, load(name), rest, quick=quick)
    finally:
        sys.argv[0] = prog
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
