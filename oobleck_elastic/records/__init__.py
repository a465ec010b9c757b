"""The records layer: every value the agent and the worker share, and every value kept in etcd.

Invariant: each value has one record class that writes JSON and reads it back validated; a
malformed value is logged and ignored, never unpickled or executed. It sits below the control
plane and the data plane and imports `etcd`, `planning` and the standard library only. The
story: docs/design.md.
"""
