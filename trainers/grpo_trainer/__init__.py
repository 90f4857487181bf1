"""grpo_trainer: the GRPO training workload (losses, loop, MoE expert parallelism, checkpoints)."""
