"""Data plane: the worker that trains a plan's stage and keeps training through reconfigurations.

The loop lives at this package's root: `run` (the worker entry: one `train(cfg)` for torchrun,
the local simulation and the single process), `worker` (a worker's part of each generation:
enter, run the steps, answer their results), `runner` (the step thread the loop watches),
`control` (the `ControlPlane` protocol the loop is handed: the etcd-backed one is
`rendezvous.worker`, the in-process one `LocalControl`), `trainer` (the `Trainer`: one step of a
stage, composed of the pieces below), `updates` (a step's writes to the worker state, only while
the step is current), `portable` (its state as checkpoints read and write it) and
`checkpointing` (saving, restoring and when).

By concept below it: `step/` (what one step computes: optimizer, loss, compiled layers, stage
shapes, the commit vote, the step's result), `generation/` (entering a plan: process groups, devices, moving
layers, the stage built and run), `resilience/` (guard, fingerprints, stragglers, heartbeat, fault injection, error
classes) and `telemetry/` (metrics, MFU, goodput, the run log, memory).

Imports: the engine may import `records`, `data`, `planning`, `models`, `etcd`, `config` and
`logs`, never `rendezvous` (the control plane is handed in). Its sub-packages import each other
only downwards (resilience, step, generation, telemetry) and never the loop at this root, except
for type hints.
"""
