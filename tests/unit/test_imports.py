"""The house rules of the package's imports, checked on every module (function-local imports too).

1. No import cycle between modules of `oobleck_elastic`.
2. Every import between the package's parts follows the planes (`ALLOWED` below, docs/design.md):
   the control plane, planning, the records layer and the data pipeline never import the engine;
   planning is pure numbers (no etcd, no control plane); the engine's sub-packages import each
   other only downwards (resilience, step, then stage and entry side by side, telemetry) and never
   the loop at its root; planning's rooms too (errors and comm, profile, templates, schedules, plan,
   tolerance), with `planning.job` and the package's face at its root, the one entry for the rest of
   the package.
3. No private name (`_name`) is taken from another module, by `from m import _name` or `m._name`.
4. No module of planning outside `planning.profile` imports torch (type-checker imports included),
   and importing `oobleck_elastic.planning` does not load it.

Imports under `if TYPE_CHECKING:` are for the type checker only and are not counted. The rules are
pure functions of the modules' import lists (`imports_of`, `cycles`, `plane_violations`,
`private_violations`), each tested below on made-up modules, so the check is shown to fail.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

PACKAGE = "oobleck_elastic"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

ENGINE_PARTS = ("resilience", "step", "stage", "entry", "telemetry")
PLANNING_PARTS = ("errors", "comm", "profile", "templates", "schedules", "plan", "tolerance")
"""Planning's rooms, from the bottom up (`ALLOWED` says which may import which)."""
TORCH_IN_PLANNING = "planning.profile"
"""The one room of planning that may import torch (it measures layers)."""

ALLOWED: dict[str, frozenset[str]] = {
    part: frozenset(deps)
    for part, deps in {
        # floor 1: no part of the package below them
        "logs": (),
        "config": (),
        "checkpoint": ("logs",),
        "etcd": (),
        # floor 2: models, and the pure-number planes
        "models": ("checkpoint", "config"),
        "planning.errors": (),
        "planning.comm": (),
        "planning.profile": ("config", "logs", "models", "planning.comm", "planning.errors"),
        "planning.templates": ("planning.comm", "planning.errors", "planning.profile"),
        "planning.schedules": ("config", "planning.comm", "planning.errors", "planning.profile", "planning.templates"),
        "planning.plan": ("planning.errors", "planning.schedules", "planning.templates"),
        "planning.tolerance": ("planning.errors", "planning.plan", "planning.templates"),
        "planning": ("config", "logs", "models", *(f"planning.{part}" for part in PLANNING_PARTS)),
        "simulate": ("config", "logs", "planning"),
        "data": ("config", "models"),
        "testing": ("planning",),
        # floor 3: the records every agent and worker share
        "records": ("etcd", "planning"),
        # floor 4: the control plane
        "rendezvous": ("config", "etcd", "logs", "planning", "records"),
        # floor 4: the data plane, its sub-packages from the bottom up, the loop at its root
        "engine.resilience": ("config", "etcd", "logs", "models", "planning", "records"),
        "engine.step": ("config", "engine.resilience", "logs", "models", "planning", "records"),
        "engine.stage": ("config", "engine.resilience", "engine.step", "logs", "models", "planning", "records"),
        "engine.entry": ("config", "engine.resilience", "engine.step", "logs", "models", "planning", "records"),
        "engine.telemetry": (
            "config",
            "engine.entry",
            "engine.resilience",
            "engine.stage",
            "engine.step",
            "logs",
            "models",
            "planning",
            "records",
        ),
        "engine": (
            "checkpoint",
            "config",
            "data",
            "engine.entry",
            "engine.resilience",
            "engine.stage",
            "engine.step",
            "engine.telemetry",
            "etcd",
            "logs",
            "models",
            "planning",
            "records",
        ),
        # floor 5: operations and the command line
        "cluster_ops": ("config", "etcd", "logs", "planning", "records", "rendezvous"),
        "cli": ("checkpoint", "cluster_ops", "config", "etcd", "logs", "models", "planning", "simulate"),
    }.items()
}
"""What each part of the package may import (besides itself and the package's empty face)."""


@dataclass(frozen=True)
class Import:
    """One name or module one module imports from another module of the package."""

    module: str
    """The importing module (dotted)."""
    target: str
    """The imported module (dotted): `a.b` for `from a.b import x`, `a.b.c` when `c` is a module."""
    name: str | None
    """The name taken from `target` (None: the module itself)."""
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_runtime(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node except those under `if TYPE_CHECKING:` (their `else` branches are kept)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(sources: Mapping[str, str], package: str = PACKAGE) -> list[Import]:
    """The package-internal imports of every module in `sources` ({dotted module: source text};
    a package's `__init__` under the package's own name), function-local ones included, with the
    private attributes read from imported modules (`m._name`) as imports of that name."""
    packages = {m for m in sources if any(o.startswith(m + ".") for o in sources)}
    out: list[Import] = []
    for mod, text in sources.items():
        tree = ast.parse(text)
        here = mod.split(".") if mod in packages else mod.split(".")[:-1]
        bound: dict[str, str] = {}  # local name -> imported module
        for node in _walk_runtime(tree):
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                if not (target == package or target.startswith(package + ".")):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in sources:
                        out.append(Import(mod, sub, None, node.lineno))
                        bound[alias.asname or alias.name] = sub
                    else:
                        out.append(Import(mod, target, alias.name, node.lineno))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(package + ".") and alias.name in sources:
                        out.append(Import(mod, alias.name, None, node.lineno))
                        if alias.asname:
                            bound[alias.asname] = alias.name
        for node in _walk_runtime(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                out.append(Import(mod, bound[node.value.id], node.attr, node.lineno))
    return out


def cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's algorithm; the package's graph is shallow enough to recurse
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def part_of(module: str, package: str = PACKAGE) -> str:
    """The part of the package a module belongs to: `etcd`, `engine.step`, `engine` (its root), ..."""
    parts = module.split(".")[1:]
    if not parts:
        return ""
    if parts[0] == "engine" and len(parts) > 1 and parts[1] in ENGINE_PARTS:
        return f"engine.{parts[1]}"
    if parts[0] == "planning" and len(parts) > 1 and parts[1] in PLANNING_PARTS:
        return f"planning.{parts[1]}"
    return parts[0]


def plane_violations(imports: Iterable[Import], allowed: Mapping[str, frozenset[str]]) -> list[str]:
    """One line per import between parts that `allowed` does not list (or from an unlisted part).
    From outside planning, all of planning counts as one part ("planning")."""
    out = []
    for imp in imports:
        src, dst = part_of(imp.module), part_of(imp.target)
        if dst.startswith("planning.") and not src.startswith("planning"):
            dst = "planning"
        if not dst or src == dst:
            continue
        if src not in allowed:
            out.append(f"{imp.module}: part '{src}' is not in the plane table (ALLOWED in tests/unit/test_imports.py)")
        elif dst not in allowed[src]:
            what = f"{imp.target}.{imp.name}" if imp.name else imp.target
            out.append(f"{imp.module}:{imp.line} imports {what}: '{src}' may not import '{dst}'")
    return sorted(set(out))


def private_violations(imports: Iterable[Import]) -> list[str]:
    """One line per private name (`_name`, not dunder) taken from another module."""
    return sorted(
        {
            f"{imp.module}:{imp.line} takes {imp.name} from {imp.target}"
            for imp in imports
            if imp.name and imp.name.startswith("_") and not imp.name.startswith("__") and imp.module != imp.target
        }
    )


def torch_violations(sources: Mapping[str, str], package: str = PACKAGE) -> list[str]:
    """One line per import of torch by a module of planning outside `TORCH_IN_PLANNING`, function-local
    and type-checker-only imports included."""
    out = []
    for mod, text in sources.items():
        part = part_of(mod, package)
        if not part.startswith("planning") or part == TORCH_IN_PLANNING:
            continue
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            if any(n == "torch" or n.startswith("torch.") for n in names):
                out.append(f"{mod}:{node.lineno} imports torch outside {package}.{TORCH_IN_PLANNING}")
    return sorted(out)


def package_sources(root: Path = ROOT) -> dict[str, str]:
    return {module_name(p, root): p.read_text() for p in sorted(root.rglob("*.py"))}


# ---------------------------------------------------------------------------- the package itself
def test_the_package_has_no_import_cycle() -> None:
    imports = imports_of(package_sources())
    found = cycles((i.module, i.target) for i in imports)
    assert not found, "import cycles (function-local imports count): " + "; ".join(" <-> ".join(c) for c in found)


def test_every_import_follows_the_planes() -> None:
    sources = package_sources()
    parts = {part_of(m) for m in sources} - {""}
    assert parts <= set(ALLOWED), f"parts with no row in ALLOWED: {sorted(parts - set(ALLOWED))}"
    bad = plane_violations(imports_of(sources), ALLOWED)
    assert not bad, "imports across the planes:\n" + "\n".join(bad)


def test_no_private_name_crosses_a_module() -> None:
    bad = private_violations(imports_of(package_sources()))
    assert not bad, "private names taken from other modules:\n" + "\n".join(bad)


def test_no_torch_in_planning_outside_its_profile_room() -> None:
    bad = torch_violations(package_sources())
    assert not bad, "torch in planning:\n" + "\n".join(bad)


def test_importing_planning_does_not_load_torch() -> None:
    code = f"import sys, {PACKAGE}.planning; print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False", out.stderr


# ---------------------------------------------------------------------------- the rules, on made-up modules
def _fake(**modules: str) -> dict[str, str]:
    return {f"{PACKAGE}.{k}".replace("__init__", "").rstrip("."): v for k, v in modules.items()}


def test_a_function_local_import_closes_a_cycle() -> None:
    src = _fake(**{"models": "", "models.a": "from .b import f\n", "models.b": "def f():\n    from .a import g\n"})
    found = cycles((i.module, i.target) for i in imports_of(src))
    assert found == [[f"{PACKAGE}.models.a", f"{PACKAGE}.models.b"]]


def test_an_import_for_the_type_checker_only_is_not_a_cycle() -> None:
    src = _fake(
        **{
            "models": "",
            "models.a": "from .b import f\n",
            "models.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n",
        }
    )
    assert cycles((i.module, i.target) for i in imports_of(src)) == []


def test_the_control_plane_importing_the_engine_is_named() -> None:
    src = _fake(
        **{
            "engine": "",
            "engine.resilience": "",
            "engine.resilience.errors": "class E(Exception): ...\n",
            "rendezvous": "",
            "rendezvous.handler": "def f():\n    from ..engine.resilience.errors import E\n",
            "engine.trainer": "from .resilience import errors\n",
        }
    )
    bad = plane_violations(imports_of(src), ALLOWED)
    assert bad == [
        f"{PACKAGE}.rendezvous.handler:2 imports {PACKAGE}.engine.resilience.errors.E: "
        "'rendezvous' may not import 'engine.resilience'"
    ]


def test_an_engine_sub_package_importing_the_loop_is_named() -> None:
    src = _fake(
        **{
            "engine": "",
            "engine.trainer": "class Trainer: ...\n",
            "engine.telemetry": "",
            "engine.telemetry.runlog": "from ..trainer import Trainer\n",
        }
    )
    assert plane_violations(imports_of(src), ALLOWED) == [
        f"{PACKAGE}.engine.telemetry.runlog:1 imports {PACKAGE}.engine.trainer.Trainer: "
        "'engine.telemetry' may not import 'engine'"
    ]


def test_the_step_importing_what_is_built_at_entry_is_named() -> None:
    src = _fake(
        **{
            "engine": "",
            "engine.step": "",
            "engine.step.grad_sync": "from ..entry.groups import GenerationGroups\n",
            "engine.entry": "",
            "engine.entry.groups": "class GenerationGroups: ...\n",
            "engine.stage": "",
            "engine.stage.build": "from ..entry.groups import GenerationGroups\n",
        }
    )
    assert plane_violations(imports_of(src), ALLOWED) == [
        f"{PACKAGE}.engine.stage.build:1 imports {PACKAGE}.engine.entry.groups.GenerationGroups: "
        "'engine.stage' may not import 'engine.entry'",
        f"{PACKAGE}.engine.step.grad_sync:1 imports {PACKAGE}.engine.entry.groups.GenerationGroups: "
        "'engine.step' may not import 'engine.entry'",
    ]


def test_private_names_from_other_modules_are_named() -> None:
    src = _fake(
        **{
            "etcd": "",
            "etcd.client": "_RETRY_S = 1\n",
            "etcd.mirror": "from .client import _RETRY_S\nfrom . import client\nx = client._RETRY_S\n",
        }
    )
    assert private_violations(imports_of(src)) == [
        f"{PACKAGE}.etcd.mirror:1 takes _RETRY_S from {PACKAGE}.etcd.client",
        f"{PACKAGE}.etcd.mirror:3 takes _RETRY_S from {PACKAGE}.etcd.client",
    ]


def test_a_planning_room_importing_one_above_is_named() -> None:
    src = _fake(
        **{
            "planning": "",
            "planning.templates": "",
            "planning.templates.templates": "from ..plan.plan import Plan\n",
            "planning.plan": "",
            "planning.plan.plan": "class Plan: ...\n",
            "simulate": "",
            "simulate.run": "from ..planning.plan.plan import Plan\n",
        }
    )
    assert plane_violations(imports_of(src), ALLOWED) == [
        f"{PACKAGE}.planning.templates.templates:1 imports {PACKAGE}.planning.plan.plan.Plan: "
        "'planning.templates' may not import 'planning.plan'"
    ]


def test_torch_outside_planning_profile_is_named() -> None:
    src = _fake(
        **{
            "planning": "",
            "planning.profile": "",
            "planning.profile.profiler": "import torch\n",
            "planning.schedules": "",
            "planning.schedules.sim": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from torch import nn\n",
            "models": "import torch\n",
        }
    )
    assert torch_violations(src) == [
        f"{PACKAGE}.planning.schedules.sim:3 imports torch outside {PACKAGE}.{TORCH_IN_PLANNING}"
    ]
