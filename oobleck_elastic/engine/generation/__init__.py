"""Entering a generation: from a published plan to an installed stage, in-process.

`entry` (`GenerationEntry`: connect, agree on the committed step, move layers, install the
stage), `groups` (the generation's process groups and the exact cross-replica gradient sync),
`reconfigure` (who sends which layer, weights and optimizer state, to whom), `kept` (the layers
kept in place), `shadows` (the host-memory shadow copies) and `devices` (the worker's device, its
backends, tearing groups down).

Imports: `models`, `planning`, `config`, `logs` and `engine.step` (the optimizer the moved
state is installed into); never the engine's root, `resilience` or `telemetry`.
"""
