"""The configuration reference: every section and field of the schema, rendered as Markdown.

Python keeps no docstring for a dataclass field, so they are read from the source: each section
class is parsed (ast), and a string right below an annotated field is that field's docstring.
The type comes from the annotation (a choice field's `Literal[...]` lists its choices), the
default from a section built with no arguments. `oobleck config reference` prints the reference;
docs/config.md is that output, checked in, and a test fails when the two differ.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
import types
from dataclasses import fields, is_dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from .job import JobConfig

REGENERATE = "oobleck config reference > docs/config.md"

_HEADER = f"""# Configuration reference

<!-- Generated from the field docstrings of the sections in oobleck_elastic/config/ by
     `{REGENERATE}`; edit the docstrings, not this file. -->

A job config is a YAML file (see `configs/`) with the sections below; a key it does not give keeps
its default. `key=value` arguments override any key (`oobleck plan --config CFG --nodes 4
training.steps=10`, `examples/train.py --config CFG planning.schedule=gpipe`). An unknown key, a
value of the wrong type, a choice that is not listed and every broken rule are reported together
when the config is loaded, in one error that names each key.

**Paths.** A relative path written in a config file (`data.paths`, `data.tokenizer_path`,
`data.cache_dir`, `model.pretrained_path`, `planning.profile_path`,
`planning.classes.<name>.profile_path`, `checkpoint.dir`,
`logging.tensorboard_dir`, `logging.events_dir`) is relative to the folder of that file, whatever
directory the job starts in: `configs/my.yaml` with `data.paths: [corpus.jsonl]` reads
`configs/corpus.jsonl`. A relative path given as a `key=value` override on the command line, and
the defaults (`.oobleck-cache`, `checkpoints/<job>`, `runs`), are relative to the working directory.
`~` is expanded.
"""


def field_docs(section: type) -> dict[str, str]:
    """The docstring under each field of the dataclass `section`, by field name, as one paragraph."""
    cls = ast.parse(textwrap.dedent(inspect.getsource(section))).body[0]
    docs: dict[str, str] = {}
    for node, after in zip(cls.body, cls.body[1:]) if isinstance(cls, ast.ClassDef) else ():
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def type_text(hint: Any) -> str:
    """A field's type in the words of a YAML user: `int`, `int or null`, one of `a`, `b`, ..."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (Union, types.UnionType):
        named = [type_text(a) for a in args if a is not type(None)]
        return " or ".join(named + (["null"] if type(None) in args else []))
    if origin is list:
        return f"list of {type_text(args[0])}"
    return getattr(hint, "__name__", str(hint))


def _cell(text: str) -> str:
    """`text` fit for a table cell: pipes escaped, and asterisks outside `code` (`*.jsonl`)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(part if i % 2 else part.replace("*", "\\*") for i, part in enumerate(parts))


def _render_section(section: type, key: str, about: str, out: list[str]) -> None:
    """The table of `section` (at dotted `key`, "" for the top level), then its nested sections."""
    hints, docs, defaults = get_type_hints(section), field_docs(section), section()
    named = {
        f.name
        for f in fields(section)
        if get_origin(hints[f.name]) is dict and is_dataclass(get_args(hints[f.name])[1])
    }
    nested = [f for f in fields(section) if is_dataclass(hints[f.name]) or f.name in named]
    level = "#" * (2 + key.count("."))
    out += ["", f"{level} `{key}`" if key else f"{level} Top level", ""]
    if about:
        out += [about, ""]
    out += ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for f in fields(section):
        if f in nested:
            continue
        default = _cell("`" + json.dumps(getattr(defaults, f.name)) + "`")
        full = f"{key}.{f.name}" if key else f.name
        out.append(f"| `{full}` | {_cell(type_text(hints[f.name]))} | {default} | {_cell(docs[f.name])} |")
    for f in nested:
        full = f"{key}.{f.name}" if key else f.name
        if f.name in named:  # a mapping of named sections: one table for any name
            _render_section(get_args(hints[f.name])[1], f"{full}.<name>", docs[f.name], out)
        else:
            _render_section(hints[f.name], full, docs[f.name], out)


def render_reference() -> str:
    """The Markdown reference of every section and field of JobConfig, in schema order."""
    out = [_HEADER.rstrip()]
    _render_section(JobConfig, "", "", out)
    return "\n".join(out) + "\n"
