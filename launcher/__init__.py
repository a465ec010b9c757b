"""Ways to start a job: a local multi-node simulation with embedded etcd, SLURM and Kubernetes
recipes (built with the control plane). The story: docs/running.md."""
