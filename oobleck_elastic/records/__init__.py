"""The records layer: every value the agent and the worker share, and every value kept in etcd.

`keys` (the etcd key layout of a job), `control` (node records, rosters, events, readiness,
progress, stragglers, the leader's and the fences' records), `read` (reading them tolerantly),
`plans` (plans and rosters parsed
once per revision), `errors` (the error that ended a worker), `heartbeat` (the line a worker
writes for its own agent), `goodput` (the job's goodput ledger) and `board` (the job's
TensorBoard run, chosen once). Each value has one record class
that writes JSON and reads it back validated: a malformed value is logged and ignored, never
unpickled or executed.

This layer sits below both the control plane (`rendezvous/`, `cluster_ops`) and the data plane
(`engine/`): it imports `etcd`, `planning` and the standard library only.
"""
