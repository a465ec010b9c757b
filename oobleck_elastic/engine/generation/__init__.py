"""Entering a generation: from a published plan to an installed stage, in-process.

`entry` (`GenerationEntry`: connect, agree on the committed step, move layers, install the
stage), `groups` (the generation's process groups and the exact cross-replica gradient sync),
`reconfigure` (who sends which layer, weights and optimizer state, to whom), `kept` (the layers
kept in place), `shadows` (the host-memory shadow copies), `stage` (the installed stage's
modules, torch pipeline stages and schedule, and its part of a step) and `devices` (the worker's
device, its backends, tearing groups down).

Imports: `models`, `planning`, `config`, `logs`, `engine.step` (the optimizer the moved state
is installed into) and `engine.resilience` (the step thread's progress points, the straggler
clock); never the engine's root or `telemetry`.
"""
