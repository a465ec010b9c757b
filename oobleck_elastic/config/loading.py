"""Loading a job config: a YAML file plus `key=value` overrides, merged onto the schema.

The file and the overrides are merged first (an override can fix any value of the file);
whatever is wrong becomes one `ConfigError` whose clauses each name a key and what to change.
The fields: docs/config.md.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Sequence, cast, get_args, get_origin, get_type_hints

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from .job import JobConfig, default_checkpoint_dir
from .schema import PATH_KEYS, ConfigError


def _field_type(key: str) -> Any:
    """The type of the field at dotted `key` (a section's dataclass for a section), or None. Below
    a mapping of named sections (`planning.classes`), a name stands for the section's type."""
    node: Any = JobConfig
    for part in key.split("."):
        if get_origin(node) is dict:
            node = get_args(node)[1]
            continue
        if not is_dataclass(node):
            return None
        node = get_type_hints(node).get(part)
    return node


def _choices(key: str) -> tuple[str, ...]:
    """The choices of the field at `key` when it is a choice field (typed Literal), else ()."""
    kind = _field_type(key)
    return get_args(kind) if get_origin(kind) is Literal else ()


def _choice_clause(key: str, value: Any) -> str:
    return f"'{key}' is '{value}'; choose one of {', '.join(_choices(key))}"


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None)
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, ConfigKeyError) and key:
        parent, _, leaf = key.rpartition(".")
        known = _known_keys(parent)
        hint = difflib.get_close_matches(leaf, known, n=1)
        msg = f"unknown key '{key}'"
        if hint:
            msg += f": did you mean '{(parent + '.') if parent else ''}{hint[0]}'?"
        else:
            msg += f": valid keys here are {', '.join(sorted(known))}"
        return msg
    if isinstance(err, ValidationError) and key and _choices(key):
        return _choice_clause(key, getattr(err, "value", None))
    if isinstance(err, ValidationError) and key:
        return f"bad value for '{key}': {first}"
    return f"{first}" + (f" (key '{key}')" if key else "")


def _known_keys(parent: str) -> list[str]:
    node = _field_type(parent) if parent else JobConfig
    return [f.name for f in fields(node)] if is_dataclass(node) else []


def _build(given: DictConfig, where: str) -> JobConfig:
    """`given` (the YAML file with the overrides merged in) merged onto the schema, then validated.

    omegaconf stops at the first value a choice field refuses; the value is taken out of `given` and
    the merge retried, so that every bad choice becomes a clause. The rules then run on the config
    holding the values as given, and one ConfigError (its clauses after `where: `) lists the bad
    choices, then the broken rules. Any other omegaconf error (unknown key, wrong type) is raised
    as it is.
    """
    refused: dict[str, Any] = {}
    while True:
        try:
            job = cast(JobConfig, OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), given)))
            break
        except ValidationError as err:
            key = err.full_key
            parent, _, leaf = (key or "").rpartition(".")
            holder = OmegaConf.select(given, parent) if parent else given
            if not key or not _choices(key) or not isinstance(holder, DictConfig) or leaf not in holder:
                raise
            refused[key] = holder[leaf]
            del holder[leaf]
    for key, value in refused.items():  # the rules see the config as given
        parent, _, leaf = key.rpartition(".")
        holder = job
        for part in [p for p in parent.split(".") if p]:
            holder = getattr(holder, part)
        setattr(holder, leaf, value)
    problems = [_choice_clause(key, value) for key, value in refused.items()] + job.validate()
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    return job


def resolve_path(value: str, folder: Path) -> str:
    """`value` (a path written in a config file in `folder`) as an absolute path: `~` expanded,
    a relative path joined to `folder` and normalised; an empty string stays empty (= off)."""
    if not value:
        return value
    expanded = os.path.expanduser(value)
    return expanded if os.path.isabs(expanded) else os.path.normpath(os.path.join(folder, expanded))


def resolve_file_paths(given: DictConfig, folder: Path) -> None:
    """Make every path of PATH_KEYS in `given` (a loaded config file) absolute against `folder`, in
    place. Values that are not text (a wrong type, null) are left for the schema to judge."""
    folder = folder.resolve()
    for key in _path_keys(given):
        value = OmegaConf.select(given, key, default=None)
        if isinstance(value, str):
            OmegaConf.update(given, key, resolve_path(value, folder))
        elif isinstance(value, ListConfig) and all(isinstance(v, str) for v in value):
            OmegaConf.update(given, key, [resolve_path(v, folder) for v in value], merge=False)


def _path_keys(given: DictConfig) -> list[str]:
    """PATH_KEYS, each `<name>` replaced by every name `given` holds in that mapping (a mapping of
    the wrong type, or a name whose section is not one, is left for the schema to judge)."""
    keys = []
    for key in PATH_KEYS:
        head, named, tail = key.partition(".<name>.")
        if not named:
            keys.append(key)
            continue
        mapping = OmegaConf.select(given, head, default=None)
        if isinstance(mapping, DictConfig):
            keys += [f"{head}.{name!s}.{tail}" for name, section in mapping.items() if isinstance(section, DictConfig)]
    return keys


def name_checkpoint_dir(given: DictConfig, stem: str) -> None:
    """Give `given` (a config file merged with its overrides) the checkpoint directory of a job
    named `stem` (the file's name without its extension) when it sets neither `name` nor
    `checkpoint.dir`, in place; with a `name`, JobConfig names the directory after it."""
    section = given.get("checkpoint")
    if "name" in given or not (section is None or isinstance(section, DictConfig)):
        return  # a section of the wrong type is the schema's to judge
    if section is None or section.get("dir", "") == "":
        OmegaConf.update(given, "checkpoint.dir", default_checkpoint_dir(stem))


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Load a JobConfig from an optional YAML file and `key=value` overrides, validated. Relative
    paths written in the file are relative to its folder; those of the overrides to the working
    directory (schema.PATH_KEYS). An empty `checkpoint.dir` becomes `checkpoints/<job>`: <job> is
    `name`, else the file's name without its extension.

    Raises ConfigError with a message naming the offending key.
    """
    where = str(path) if path else "<defaults>"
    try:
        given = OmegaConf.create()
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file '{p}' does not exist")
            try:
                loaded = OmegaConf.load(p)
            except yaml.YAMLError as err:
                mark = getattr(err, "problem_mark", None)
                at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
                problem = getattr(err, "problem", None) or str(err).splitlines()[0]
                raise ConfigError(f"config file '{p}' is not valid YAML{at}: {problem}") from None
            if not isinstance(loaded, DictConfig):
                raise ConfigError(f"config file '{p}' is not a mapping of sections (model:, data:, training:, ...)")
            given = loaded
            resolve_file_paths(given, p.parent)
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"override '{bad[0]}' is not of the form key=value (e.g. training.steps=10)")
        if overrides:  # merged before the schema, so that an override can fix a choice the file got wrong
            given = cast(DictConfig, OmegaConf.merge(given, OmegaConf.from_dotlist(list(overrides))))
        if path is not None:
            name_checkpoint_dir(given, Path(path).stem)
        return _build(given, where)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{where}: {_omegaconf_message(err)}") from None


def to_yaml(cfg: JobConfig) -> str:
    """The config as YAML (for logs, TensorBoard and checkpoints)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: JobConfig) -> dict[str, Any]:
    """The config as plain JSON-able dict."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]


def from_dict(data: dict[str, Any]) -> JobConfig:
    """Inverse of to_dict (validated)."""
    try:
        return _build(OmegaConf.create(data), "<config>")
    except OmegaConfBaseException as err:
        raise ConfigError(f"<dict>: {_omegaconf_message(err)}") from None
