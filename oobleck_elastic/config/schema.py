"""The job config's schema: one dataclass per section, each field with a docstring below it, and
beside the fields the rules their types cannot express.

`Section` is what every section shares (its `validate()`), `ConfigError` what a broken config
raises. The field docstrings generate docs/config.md.
"""

from __future__ import annotations

from typing import Sequence


class ConfigError(ValueError):
    """A configuration problem, with a message that names the key and what to change."""


PATH_KEYS = (
    "model.pretrained_path",
    "data.paths",
    "data.tokenizer_path",
    "data.cache_dir",
    "planning.profile_path",
    "planning.classes.<name>.profile_path",
    "checkpoint.dir",
    "logging.tensorboard_dir",
    "logging.events_dir",
)
"""The keys that hold file system paths. A relative path written in a config FILE is relative to
that file's folder (`configs/x.yaml` saying `data.paths: [corpus.jsonl]` reads
`configs/corpus.jsonl`, from whatever directory the job starts in); a relative path given as a
command-line override, and the defaults (`checkpoints/<job>`, `runs`, `.oobleck-cache`), are
relative to the working directory. `load_config` makes the file's paths absolute; `~` is
expanded. `<name>` stands for every name the file gives in that mapping (a device class)."""


class Section:
    """A section of the job config. `validate()` returns one clause per broken rule of the
    section (ranges, combinations: what its field types cannot express), naming each key by its
    full dotted path; an empty list means the section is fine. A section that holds sections
    checks them too."""

    def validate(self) -> list[str]:
        return []


def at_least(prefix: str, section: object, names: Sequence[str], low: int) -> list[str]:
    """A clause for each field `names` of `section` (keys `prefix.name`) below `low`."""
    return [
        f"'{prefix}.{name}' must be >= {low} (got {getattr(section, name)})"
        for name in names
        if getattr(section, name) < low
    ]
