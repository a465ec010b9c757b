"""The `torchrun.handlers` entry point.

torch imports entry points while `torch.distributed.elastic.rendezvous` itself is being imported,
so this module must not import that package (or the handler) at import time: the creator
imports the handler when torchrun first asks for a handler.

A job config the handler cannot load (a misspelt key, a bad value) ends the agent with one line
(SystemExit), not with a traceback through torchrun.
"""

from typing import Any, Callable


def get_creator() -> Callable[[Any], Any]:
    """Zero-argument factory torch calls; returns `(RendezvousParameters) -> RendezvousHandler`."""

    def create(params: Any) -> Any:
        from ..config import ConfigError
        from .handler import OobleckRendezvousHandler

        try:
            return OobleckRendezvousHandler(params)
        except ConfigError as err:  # a setting to change: one line, and this agent exits 1 (no traceback)
            raise SystemExit(f"torchrun --rdzv-backend=oobleck: error: {err}") from None

    return create
