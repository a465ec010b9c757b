"""`PlanningError`: the model and the devices cannot be planned.

Every part of planning raises it (or a subclass: `ProfileError` aside, which is a profile's own
complaint); callers catch this one type. docs/planning.md tells the story.
"""

from __future__ import annotations

__all__ = ["PlanningError"]


class PlanningError(ValueError):
    """The model and the devices cannot be planned; the message says what to change."""
