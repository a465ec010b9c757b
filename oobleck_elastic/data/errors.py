"""The error every data problem a user can fix is reported as: one line that says what to change."""

from __future__ import annotations


__all__ = ["DataError"]


class DataError(ValueError):
    """A data problem, with a message that names the file or key and what to change."""
