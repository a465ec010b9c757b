"""Data plane: the worker that trains a plan's stage and keeps training through reconfigurations.

At this root: `run` (the loop behind `examples/train.py`), `worker` (a worker's part of one
generation), `runner` (the step thread), `control` (the `ControlPlane` the loop is handed),
`trainer` (the `Trainer`), `checkpoint_state` and `checkpointing` (checkpoints). Below it, one
room per time of running, imported only downwards: `resilience/`, `step/` (every step),
`stage/` (built at entry), `entry/` (entering a generation), `telemetry/`. docs/design.md.

Imports: `records`, `data`, `planning`, `models`, `etcd`, `config`, `logs`; never `rendezvous`.
"""
