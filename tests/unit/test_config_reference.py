"""The configuration reference: rendered from the schema's field docstrings, checked in as docs/config.md."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

from oobleck_elastic.cli import main
from oobleck_elastic.config import JobConfig
from oobleck_elastic.config.reference import REGENERATE, field_docs, render_reference, type_text

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_the_checked_in_reference_is_current() -> None:
    assert DOC.read_text() == render_reference(), f"docs/config.md is stale: regenerate it with `{REGENERATE}`"


def test_oobleck_config_reference_prints_it(capsys) -> None:
    assert main(["config", "reference"]) == 0
    assert capsys.readouterr().out == render_reference()


def test_every_field_has_a_row_with_its_type_default_and_docstring() -> None:
    text = render_reference()

    def walk(section: type, prefix: str) -> int:
        hints, docs, rows = get_type_hints(section), field_docs(section), 0
        for f in fields(section):
            key = f"{prefix}{f.name}"
            if is_dataclass(hints[f.name]):
                assert f"`{key}`" in text and docs[f.name] in text
                rows += walk(hints[f.name], key + ".")
            elif get_origin(hints[f.name]) is dict:  # named sections: one table for any name
                assert f"`{key}.<name>`" in text and docs[f.name] in text
                rows += walk(get_args(hints[f.name])[1], key + ".<name>.")
            else:
                row = [line for line in text.splitlines() if line.startswith(f"| `{key}` |")]
                assert len(row) == 1, key
                assert docs[f.name].replace("*", "\\*") in row[0]
                rows += 1
        return rows

    assert walk(JobConfig, "") > 80
    assert (
        "| `planning.schedule` | one of `1f1b`, `gpipe`, `interleaved-1f1b`, `zero-bubble`, `zbv`, `auto` "
        '| `"1f1b"` | Pipeline schedule:' in text
    )
    assert "| `model.num_kv_heads` | int or null | `null` |" in text
    assert '| `fault_tolerance.preempt_signals` | list of str | `["SIGTERM"]` |' in text


def test_type_text_words_types_for_yaml_users() -> None:
    hints = get_type_hints(JobConfig)
    training = get_type_hints(hints["training"])
    assert type_text(training["microbatch_size"]) == "int or str"
    assert type_text(training["peak_tflops"]) == "float or null"
    assert type_text(training["precision"]) == "one of `fp32`, `bf16`"
    assert type_text(get_type_hints(hints["planning"])["device_memory_gb"]) == "float or null"  # float | None
