"""The private parts of torch the engine relies on, checked once before a worker builds anything.

torch does not promise these names across releases. The package pins torch to the release they
were read against (`SUPPORTED_TORCH`, pyproject.toml), and a worker whose torch lacks one refuses
to start with a line that names it, instead of losing a mechanism (a marked wait, an abort, a
timeout) in silence. docs/troubleshooting.md.
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["INTERNALS", "SUPPORTED_TORCH", "TorchInternalsError", "check_torch_internals", "missing_internals"]

SUPPORTED_TORCH = ">=2.13,<2.14"
"""The torch releases whose internals below were read; pyproject.toml's requirement says the same."""

INTERNALS: tuple[tuple[str, str, str], ...] = (
    ("torch.distributed.pipelining.schedules", "_wait_batch_p2p", "marks a pipeline's waits for the hang watch"),
    ("torch.distributed.pipelining._backward", "stage_backward_input", "zero-bubble's input-gradient pass"),
    ("torch.distributed.pipelining._backward", "stage_backward_weight", "zero-bubble's weight-gradient pass"),
    ("torch.distributed.distributed_c10d", "_abort_process_group", "aborts a generation's communicators"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout", "applies the derived communication timeout"),
    ("torch.distributed.distributed_c10d", "_world", "finds the groups to tear down"),
    ("torch._C._distributed_c10d", "_ProcessGroupWrapper", "sets the timeout under torch's collective checker"),
    ("torch._functorch.aot_autograd", "aot_function", "traces compiled layers' split graphs"),
    ("torch._functorch.partitioners", "min_cut_rematerialization_partition", "splits compiled graphs"),
    ("torch", "_foreach_norm", "the gradient norm in one kernel"),
    ("torch", "_foreach_mul_", "gradient clipping in one kernel"),
)
"""(module, name, what the engine uses it for)."""


class TorchInternalsError(RuntimeError):
    """This torch lacks an internal the engine uses: install a supported release."""


def missing_internals() -> list[str]:
    """`module.name (what for)` for every internal this torch does not have."""
    missing = []
    for module, name, purpose in INTERNALS:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module}.{name} ({purpose})")
    return missing


def check_torch_internals() -> None:
    """Raise `TorchInternalsError` naming every missing internal and the supported releases."""
    missing = missing_internals()
    if missing:
        raise TorchInternalsError(
            f"torch {torch.__version__} lacks {', '.join(missing)}: install torch{SUPPORTED_TORCH}, "
            "the releases whose internals this version of oobleck_elastic uses"
        )
