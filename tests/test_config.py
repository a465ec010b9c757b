"""Configuration: YAML + dotlist overrides, and one clear error per kind of bad input."""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import pytest

from oobleck_elastic.config import ConfigError, JobConfig, from_dict, load_config, to_dict

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, JobConfig)
    assert from_dict(to_dict(cfg)) == cfg


def test_at_least_the_promised_configs_ship() -> None:
    assert {p.stem for p in CONFIGS} >= {"gpt2-tiny", "gpt2-small", "llama-tiny", "gpt3-175b"}


def test_dotlist_overrides_are_typed() -> None:
    cfg = load_config(CONFIGS[0], ["training.steps=10", "training.optimizer.lr=2e-3", "fault_tolerance.f=2"])
    assert cfg.training.steps == 10 and cfg.training.optimizer.lr == 2e-3 and cfg.fault_tolerance.f == 2


def test_every_field_has_a_docstring() -> None:
    import ast
    import inspect

    from oobleck_elastic import config

    tree = ast.parse(inspect.getsource(config))
    documented = set()
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
        body = cls.body
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                documented.add((cls.name, a.target.id))  # type: ignore[union-attr]

    def walk(dc):
        for f in fields(dc):
            assert (dc.__name__, f.name) in documented, f"{dc.__name__}.{f.name} has no docstring"
            default = f.default_factory() if f.default_factory is not MISSING else None  # type: ignore[misc]
            if is_dataclass(default):
                walk(type(default))

    walk(JobConfig)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.stepz=3"], "<defaults>: unknown key 'training.stepz': did you mean 'training.steps'?"),
        (
            ["training.steps=many"],
            "<defaults>: bad value for 'training.steps': Value 'many' of type 'str' could not be converted to Integer",
        ),
        (
            ["training.global_batch_size=10", "training.microbatch_size=4"],
            "<defaults>: 'training.global_batch_size' (10) must be a multiple of 'training.microbatch_size' (4): "
            "change one of them, e.g. training.global_batch_size=12",
        ),
        (
            ["fault_tolerance.f=-1"],
            "<defaults>: 'fault_tolerance.f' must be >= 0 (got -1): it is the number of "
            "simultaneous node failures to survive",
        ),
        (["planning.schedule=zigzag"], "<defaults>: 'planning.schedule' is 'zigzag'; choose one of 1f1b, gpipe"),
        (
            ["data.seq_len=128"],
            "<defaults>: 'data.seq_len' (128) exceeds 'model.max_seq_len' (64): lower "
            "data.seq_len or raise model.max_seq_len",
        ),
        (["training.steps"], "override 'training.steps' is not of the form key=value (e.g. training.steps=10)"),
    ],
)
def test_bad_input_gets_one_clear_error(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value) == message


def test_unknown_key_in_yaml_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hiden_size: 32\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert str(err.value) == f"{bad}: unknown key 'model.hiden_size': did you mean 'model.hidden_size'?"


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="config file 'nope.yaml' does not exist"):
        load_config("nope.yaml")


def test_a_malformed_yaml_file_is_one_error_naming_the_file_and_line(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  steps: 10\n  microbatch_size: [2\nmodel: {}\n")
    with pytest.raises(ConfigError, match=r"config file '.*bad.yaml' is not valid YAML at line \d+, column \d+"):
        load_config(bad)
