"""grpo-operator: turns GRPOJob manifests into rollout and trainer workloads on Kubernetes."""

__version__ = "0.1.0"
