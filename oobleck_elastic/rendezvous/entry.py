"""The `torchrun.handlers` entry point.

torch imports entry points while `torch.distributed.elastic.rendezvous` itself is being imported,
so this module must not import that package (or the handler) at import time: the creator
imports the handler when torchrun first asks for a handler.

`create_handler` picks the mode (`rendezvous.options`): `in_place` is the Oobleck handler,
`restart` torch's dynamic rendezvous on etcd. A job config the handler cannot load
(a misspelt key, a bad value) ends the agent with one line and status 2 (`exits.SettingError`),
not with a traceback through torchrun. The story: docs/running.md.
"""

from typing import Any, Callable, Optional


def create_handler(params: Any, *, argv: Optional[list[str]] = None) -> Any:
    """The handler of `params`' mode; `argv` as in `options.launch_of`."""
    from .options import launch_of, mode_of

    launch = launch_of(params, argv)
    if mode_of(launch) == "restart":
        from ..etcd import connect
        from ..records.keys import Keys
        from .options import etcd_settings, rdzv_conf
        from .restart import restart_handler

        conf = rdzv_conf(params)
        return restart_handler(
            params, connect(etcd_settings(params, conf)), Keys(conf.get("key_prefix", "/oobleck"), params.run_id)
        )
    from .handler import OobleckRendezvousHandler

    return OobleckRendezvousHandler(params, argv=argv)


def get_creator() -> Callable[[Any], Any]:
    """Zero-argument factory torch calls; returns `(RendezvousParameters) -> RendezvousHandler`."""

    def create(params: Any) -> Any:
        from ..config import ConfigError
        from ..etcd import EtcdError

        from .exits import PREFIX, STATUS_FAILED, SettingError, install_exit_hook

        install_exit_hook()  # uncaught, the errors below end torchrun with one line (rendezvous/exits.py)
        try:
            return create_handler(params)
        except ConfigError as err:  # a setting to change: one line, and this agent exits 2 (no traceback)
            raise SettingError(f"{PREFIX}: error: {err}") from None
        except EtcdError as err:  # etcd out of reach (or refused by a fork guard): one line, exit 1
            raise SettingError(f"{PREFIX}: error: {err}", STATUS_FAILED) from None

    return create
