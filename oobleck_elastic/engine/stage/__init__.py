"""The stage: what a worker builds once when it enters a generation, and every step then runs.

`build` (the stage's modules, torch `PipelineStage`s and schedule), `compiled`, `split_graphs`
and `split_layer` (layers through `torch.compile`, the backward split for zero-bubble),
`zero_bubble` (ZB-H1 at any microbatch count), `paced` (passes padded to a device class's speed)
and `shapes` (stage inputs and outputs known in advance). docs/schedules.md tells the story.

Imports: `models`, `planning`, `config`, `logs`, `engine.resilience` and `engine.step`.
"""
