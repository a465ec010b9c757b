"""Per-step batches: which samples a step trains on, each pipeline's share, and prefetch.

Invariant: a step's global batch is a function of (seed, step) alone, whatever the plan, so a
re-planned or resumed job trains on the same samples. The story: docs/training.md.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Optional, Sequence

import torch

from ..models.build import stable_seed
from .dataset import TokenWindows
from .errors import DataError

__all__ = ["GlobalBatchSampler", "pipeline_slices", "collate", "BatchPrefetcher"]


class GlobalBatchSampler:
    """The global batch of every optimizer step, a function of (seed, step) only."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int) -> None:
        if global_batch_size < 1:
            raise DataError(f"training.global_batch_size must be >= 1 (got {global_batch_size})")
        if num_samples < global_batch_size:
            raise DataError(
                f"the dataset has {num_samples} samples, fewer than one global batch "
                f"(training.global_batch_size={global_batch_size}): add data "
                "(data.paths), lower data.seq_len or lower training.global_batch_size"
            )
        self.num_samples, self.global_batch_size, self.seed = num_samples, global_batch_size, seed
        self.steps_per_epoch = num_samples // global_batch_size
        self._cached: tuple[int, torch.Tensor] | None = None
        self._inverse: tuple[int, torch.Tensor] | None = None

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of one epoch."""
        if self._cached is None or self._cached[0] != epoch:
            gen = torch.Generator().manual_seed(stable_seed(self.seed, "data-epoch", epoch))
            self._cached = (epoch, torch.randperm(self.num_samples, generator=gen))
        return self._cached[1]

    def positions(self, epoch: int, indices: Sequence[int]) -> list[int]:
        """Where each sample index stands in `epoch`'s permutation (the inverse of `indices`):
        what the sample ledger records (`records.samples`), ranges when the batch is right."""
        if self._inverse is None or self._inverse[0] != epoch:
            perm = self.epoch_permutation(epoch)
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(len(perm))
            self._inverse = (epoch, inverse)
        inv = self._inverse[1]
        return [int(inv[int(i)]) for i in indices]

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def indices(self, step: int) -> list[int]:
        """Sample indices of the global batch of optimizer step `step` (0-based)."""
        if step < 0:
            raise ValueError(f"step must be >= 0 (got {step})")
        epoch, block = divmod(step, self.steps_per_epoch)
        start = block * self.global_batch_size
        return self.epoch_permutation(epoch)[start : start + self.global_batch_size].tolist()


def pipeline_slices(plan_microbatches: Sequence[int], microbatch_size: int) -> list[tuple[int, int]]:
    """Each pipeline's contiguous [start, end) share of the global batch, in pipeline order.

    Pipeline p gets microbatch_size * b_p samples starting at microbatch_size * sum(b_q, q < p).
    """
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1 (got {microbatch_size})")
    bad = [b for b in plan_microbatches if b < 0]
    if bad:
        raise ValueError(f"microbatch counts must be >= 0 (got {list(plan_microbatches)})")
    out, cursor = [], 0
    for b in plan_microbatches:
        out.append((cursor, cursor + microbatch_size * int(b)))
        cursor += microbatch_size * int(b)
    return out


def collate(dataset: TokenWindows, indices: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples into (input_ids [n, seq_len], labels [n, seq_len]) int64 tensors."""
    pairs = [dataset[i] for i in indices]
    if not pairs:
        empty = torch.zeros(0, dataset.seq_len, dtype=torch.int64)
        return empty, empty.clone()
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


class BatchPrefetcher:
    """Collates the batch of step s+1 in a background thread while step s runs.

    `indices_of(step)` (the samples this worker takes at `step` under the current plan) is called
    on the caller's thread; the thread only collates (and pins). `get(step)` returns the prepared
    batch when it was made for this step and these indices, else builds it at once; either way the
    result is `collate(dataset, indices_of(step))`. Call `reset()` when the plan changes to drop a
    prepared batch early; an exception raised while preparing surfaces from the `get` that uses it.
    """

    def __init__(
        self, dataset: TokenWindows, indices_of: Callable[[int], Sequence[int]], *, pin_memory: bool = False
    ) -> None:
        self.dataset, self.indices_of = dataset, indices_of
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        self.hits = self.misses = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prefetch")
        self._next: Optional[tuple[int, list[int], Future]] = None
        self.last: Optional[tuple[int, list[int]]] = None
        """(step, the sample indices) of the last batch `get` returned."""

    def _build(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = collate(self.dataset, indices)
        return (x.pin_memory(), y.pin_memory()) if self.pin_memory else (x, y)

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of `step`; then starts preparing step + 1."""
        indices = [int(i) for i in self.indices_of(step)]
        self.last = (step, indices)
        pending, self._next = self._next, None
        if pending is not None and pending[0] == step and pending[1] == indices:
            batch = pending[2].result()
            self.hits += 1
        else:
            batch = self._build(indices)
            self.misses += 1
        try:
            upcoming = [int(i) for i in self.indices_of(step + 1)]
        except Exception:  # noqa: BLE001 - no next step (yet): get(step + 1) will say why
            return batch
        self._next = (step + 1, upcoming, self._pool.submit(self._build, upcoming))
        return batch

    def reset(self) -> None:
        """Drop the prepared batch (the plan changed)."""
        self._next = None

    def close(self) -> None:
        self._next = None
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "BatchPrefetcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
