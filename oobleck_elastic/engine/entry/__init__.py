"""Entering a generation: from a published plan to this worker's layers, in-process.

`enter` (`GenerationEntry`: connect, agree on the committed step, move layers, install them),
`groups` (the generation's process groups, who holds what), `reconfigure` (who sends which
layer, weights and optimizer state, to whom), `kept_layers` (the layers kept in place),
`shadow_seeding` (the new plan's shadow copies) and `devices` (devices, backends, teardown).
docs/recovery.md tells the story.

Imports: `models`, `planning`, `config`, `logs`, `engine.resilience` and `engine.step`.
"""
