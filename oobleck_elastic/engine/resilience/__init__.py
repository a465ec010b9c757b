"""Resilience inside the worker: what keeps a step correct, or stops it with a clear reason.

`guard` (a non-finite or spiking step is never applied), `fingerprint` (silent corruption of a
layer copy found and repaired by its holders), `straggler` (a slow node named and the batch
re-split around it), `heartbeat` (the worker's progress, on a file its agent reads), `faults`
(fault injection for tests and drills), `nccl_rules` (NCCL's communicator rules, checked on any
backend) and `errors` (communication errors, abandoned steps, failed jobs).

Imports: `records`, `models`, `planning`, `etcd` (error classes) and the standard library;
nothing else of the engine: the other sub-packages build on these.
"""
