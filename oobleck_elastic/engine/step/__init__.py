"""The step: what one training step of a stage computes, independent of how the stage was entered.

`optim` (AdamW, the learning-rate schedule, loss scaling and clipping, shared by the reference
and the engine), `loss` (the token-sum loss over the real vocabulary), `compiled` (layers run
through `torch.compile`, warmed before the worker joins), `shapes` (stage inputs and outputs
known in advance), `commit` (`CommitVote`: what the step's commit all-reduce carries, the point
after which a worker applies the step) and `result` (`StepResult`, bf16 `Autocast`). The
`Trainer` that runs a step lives at the engine's root.

Imports: `models`, `planning`, `config`, `logs` and `engine.resilience`; nothing else of the
engine.
"""
