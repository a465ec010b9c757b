"""Measure a tensor-parallel profile: every layer sharded over the devices of one node.

    torchrun --standalone --nproc-per-node T -m oobleck_elastic.planning.profile.tp \\
        --config CFG --out FILE [key=value ...]

The T processes measure each layer together in lockstep, sharded as the engine shards it, so the
times include its all-reduces and the bytes are one device's share; rank 0 writes the profile with
`tensor_parallel = T` (`{tp}` in `--out` is replaced by T). CUDA uses NCCL, the CPU gloo.
docs/planning.md.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ...config import JobConfig, load_config
from .cache import device_memory_bytes, profile_key
from .profile import ModelProfile
from .profiler import profile_model


def profile_tensor_parallel(
    cfg: JobConfig, *, device: torch.device, log: Callable[[str], None] | None = print
) -> ModelProfile:
    """The profile at the degree of the default process group's size (every rank calls this)."""
    from torch.distributed.device_mesh import DeviceMesh

    from ...models.tensor_parallel import parallelize_layer

    tp = dist.get_world_size()
    world = dist.group.WORLD
    assert world is not None, "init_process_group first"
    mesh = DeviceMesh.from_group(world, device.type)
    key = profile_key(cfg, device=device) | {"tensor_parallel": tp}
    prof = profile_model(
        cfg,
        device=device,
        key=key,
        prepare=lambda layer: parallelize_layer(layer, mesh),
        log=log if dist.get_rank() == 0 else None,
    )
    prof.tensor_parallel = tp
    prof.device_memory_bytes = device_memory_bytes(device)
    return prof


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True, help="profile JSON to write ({tp} is replaced by the degree)")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and cfg.training.device != "cpu"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        prof = profile_tensor_parallel(cfg, device=device)
        if dist.get_rank() == 0:
            out = Path(args.out.replace("{tp}", str(prof.tensor_parallel)))
            prof.save(out)
            print(f"wrote {out} (tensor_parallel={prof.tensor_parallel}, {prof.num_layers} layers)")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
