"""The reward model server (spec.reward.model): `python -m grpo_rollout reward` serves POST /score.

`base` holds the interface and the registry of kinds (classifier, generative), one file each;
`server` is the HTTP shell the rollout servers' `grpo_rollout.rewards.model_client` calls.
"""
