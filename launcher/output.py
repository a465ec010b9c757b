"""What the local launcher prints of its nodes' output, and where it keeps the rest.

Every line a node prints goes whole to `<log dir>/<run id>/nodes/<K>.log`. Without `-v` the
terminal (`terminal_line`) leaves out per-node details (`DETAILS`), shows a line several nodes
say in the same words once within `DEDUP_S` seconds, and shortens log records' times; with `-v`
every line is shown as the node printed it, prefixed by `[node K/ID]`. docs/running.md.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["DEDUP_S", "DETAILS", "Terminal"]

DETAILS = (
    " INFO data: ",
    "entered from generation",
    "memory on entering:",
    "communication timeout ",
    "profiling layer ",
    "profiling: ",
    "profile: saved ",
    "published the profile",
    ": measuring the profile of ",  # the "profile: " line that follows says it
    "compiled graphs so far",
)
"""Substrings of the node lines shown only with -v (they stay in the node logs)."""

DEDUP_S = 30.0
"""A line repeated by another node (numbers aside) within this many seconds is not shown again."""

_RECORD = re.compile(r"^\d{4}-\d\d-\d\d (\d\d:\d\d:\d\d),\d+ (\w+) ")
_NUMBERS = re.compile(r"\d+(?:\.\d+)?")
_WHO = re.compile(r"^(?:(?:gen|step|node|rank|leader) \S+ )*(?:gen|step|node|rank|leader) \S+: ")


class Terminal:
    """Which node lines reach the terminal, and how they look there (module docstring)."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self._seen: dict[str, tuple[int, float]] = {}
        """A shown line's gist -> (the node that said it, when)."""

    def node_line(self, node: int, line: str, now: float) -> Optional[str]:
        """`line` (without its newline) of node `node` as the terminal shows it, or None when it is
        not shown."""
        if self.verbose:
            return line
        if any(d in line for d in DETAILS):
            return None
        record = _RECORD.match(line)
        text = line[record.end() :] if record else line
        if record is None or record.group(2) != "INFO":  # INFO lines (progress) are one node's
            gist = _NUMBERS.sub("#", _WHO.sub("", text))
            said = self._seen.get(gist)
            if said is not None and said[0] != node and now - said[1] < DEDUP_S:
                return None
            self._seen[gist] = (node, now)
        if record is None:
            return line
        time_of_day, level = record.groups()
        return f"{time_of_day} {'' if level == 'INFO' else level + ' '}{text}"
