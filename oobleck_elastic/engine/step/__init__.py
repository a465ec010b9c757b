"""The step: what runs at every step on the stage built at entry.

`forward_backward` (the stage's part of the schedule), `grad_sync` (the gradient sums among each
layer's holders, then the norm and the loss), `shadows` (the shadow copies' gradient exchange),
`commit` (the commit vote: the protocol of exactly-once steps), `apply` (the optimizer update
and the step guard's verdict, only while the step is current), `state` (`WorkerState`),
`optim`, `loss` and `result`. docs/training.md tells the story.

Imports: `models`, `planning`, `config`, `logs`, `records` and `engine.resilience`.
"""
