"""The data pipeline: from a user's text or tokens to the global batches of every step.

The data order is a function of (seed, step) only, so a worker of any plan reads exactly the
samples of its pipeline's microbatches, and a reconfiguration or a restore loses and repeats no
sample.

Imports: `config`, `models` (the seed of a stable hash) and third-party libraries; never the
engine, the control plane or planning. The story: docs/training.md.
"""
