"""Data plane: pipelines from a plan on torch.distributed.pipelining, exact cross-replica
gradient sync (`groups`), the shared math of the reference and the engine (`optim`), the
trainer (`trainer`), data (`data`), metrics and the worker entry (`run`)."""
