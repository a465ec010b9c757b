"""The `torchrun.handlers` entry point.

torch imports entry points while `torch.distributed.elastic.rendezvous` itself is being imported,
so this module must not import that package (or the handler) at import time: the creator
imports the handler when torchrun first asks for a handler.
"""

from typing import Any, Callable


def get_creator() -> Callable[[Any], Any]:
    """Zero-argument factory torch calls; returns `(RendezvousParameters) -> RendezvousHandler`."""

    def create(params: Any) -> Any:
        from .handler import OobleckRendezvousHandler

        return OobleckRendezvousHandler(params)

    return create
