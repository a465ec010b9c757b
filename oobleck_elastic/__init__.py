"""oobleck_elastic: resilient distributed training with pipeline templates on native PyTorch.

Planes (docs/design.md): `rendezvous` (control: etcd membership, leader, plans), `planning`
(profile -> templates -> plan, pure numbers), `engine` (data: pipelines, gradient sync,
reconfiguration, checkpoints). `config` holds the job schema; `models` turns causal LMs into
flat layer lists.
"""

__version__ = "0.1.0"
