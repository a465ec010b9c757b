"""Log lines that say where they come from, and the same lines as JSON for programs.

`JobLog` prefixes a worker's line with where the job stands (`gen G step S node N rank R`); with
`logging.events_dir` set, every record that names an `event` is also written as one JSON line,
which tools read with `read_event_lines`. The story: docs/operations.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
from pathlib import Path
from typing import Any, Iterable, MutableMapping, Optional

__all__ = ["JobLog", "EventLines", "attach_event_lines", "clip", "event_line", "read_event_lines", "where_prefix"]

_ORDER = ("gen", "step", "node", "rank")


def where_prefix(where: dict[str, Any]) -> str:
    """`gen 3 step 12/20 node n1 rank 0: ` for the fields present (none: the empty string)."""
    parts = []
    for key in _ORDER:
        if where.get(key) is None:
            continue
        value = where[key]
        if key == "step" and where.get("total") is not None:
            value = f"{value}/{where['total']}"
        parts.append(f"{key} {value}")
    return " ".join(parts) + ": " if parts else ""


_SOURCE_AT = re.compile(r"^\[[^\]\s]*\.(?:cc|cpp|c|h|hpp|py):\d+\]\s*")
"""A C++ source location that leads some messages (gloo's `[/.../pair.cc:537] Read error ...`)."""


def clip(text: str, limit: int = 160) -> str:
    """`text` for one log line: a leading source location dropped, at most `limit` characters,
    cut at a word boundary with "…" (a text that fits is kept whole)."""
    text = _SOURCE_AT.sub("", text)
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:.") + "…"


class JobLog(logging.LoggerAdapter):
    """A logger whose lines start with `gen/step/node/rank` (docs/operations.md)."""

    def __init__(self, logger: logging.Logger, **where: Any) -> None:
        super().__init__(logger, where)

    def at(self, **where: Any) -> "JobLog":
        """This log with more of the place known (later values win)."""
        return JobLog(self.logger, **{**(self.extra or {}), **where})

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        where = dict(self.extra or {})
        event, fields = kwargs.pop("event", None), kwargs.pop("fields", None)
        extra = dict(kwargs.get("extra") or {})
        prefix = where_prefix(where)
        extra.update(oobleck_where=where, oobleck_prefix=prefix, oobleck_event=event, oobleck_fields=fields or {})
        kwargs["extra"] = extra
        return prefix + str(msg), kwargs


class EventLines(logging.Handler):
    """Writes every record that carries an `event` as one JSON line (docs/operations.md)."""

    def __init__(self, path: Path) -> None:
        super().__init__(level=logging.DEBUG)
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")

    def emit(self, record: logging.LogRecord) -> None:  # under the handler's own lock (Handler.handle)
        event = getattr(record, "oobleck_event", None)
        if event is None:
            return
        try:
            where = getattr(record, "oobleck_where", {})
            line: dict[str, Any] = {"t": round(record.created, 6), "level": record.levelname, "event": event}
            line.update({k: where[k] for k in (*_ORDER, "total") if where.get(k) is not None})
            line["msg"] = record.getMessage().removeprefix(getattr(record, "oobleck_prefix", ""))  # the place has keys
            line.update(getattr(record, "oobleck_fields", {}))
            self._fh.write(json.dumps(line, default=str) + "\n")
            self._fh.flush()
        except Exception:  # noqa: BLE001 - logging must never break training
            self.handleError(record)

    def close(self) -> None:
        with self.lock or threading.Lock():  # not while a record is being written
            self._fh.close()
        super().close()


def attach_event_lines(directory: str | Path, logger: str = "oobleck_elastic") -> Optional[EventLines]:
    """Add an `EventLines` handler for this process under `directory` to `logger` (once per
    process and directory); None when `directory` is empty."""
    if not directory:
        return None
    d = Path(directory).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"events-{socket.gethostname()}-{os.getpid()}.jsonl"
    target = logging.getLogger(logger)
    for h in target.handlers:
        if isinstance(h, EventLines) and h.path == path:
            return h
    handler = EventLines(path)
    target.addHandler(handler)
    return handler


def event_line(event: str, fields: dict[str, Any], logger: str = "oobleck_elastic", **where: Any) -> bool:
    """Write one JSON event line (docs/operations.md) to this process's `EventLines` handlers of
    `logger` and nowhere else (no text line); False when no events directory is attached."""
    handlers = [h for h in logging.getLogger(logger).handlers if isinstance(h, EventLines)]
    if not handlers:
        return False
    record = logging.LogRecord(logger, logging.INFO, __file__, 0, "", None, None)
    record.oobleck_event, record.oobleck_where, record.oobleck_fields = event, where, fields
    for h in handlers:
        h.handle(record)
    return True


def read_event_lines(directory: str | Path, events: Optional[Iterable[str]] = None) -> list[dict[str, Any]]:
    """Every JSON event line under `directory` (of the kinds in `events`, all when None), by time.
    A torn last line (a process killed while writing) is skipped."""
    wanted = None if events is None else set(events)
    out: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("events-*.jsonl")):
        for text in path.read_text(encoding="utf-8").splitlines():
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            if wanted is None or line.get("event") in wanted:
                out.append(line)
    out.sort(key=lambda e: e["t"])
    return out
