"""Reward functions: built-ins and `module:function` plugins, scored by `grpo_rollout.rewards.scorer`."""
