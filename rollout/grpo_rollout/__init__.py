"""grpo_rollout: generation servers (vLLM on GPU, torch on CPU), their HTTP API and rewards."""
