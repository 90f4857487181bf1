"""What the trainer and the rollout servers must agree on, in one package both import.

- `protocol`: the rollout HTTP API's request and response models (versioned).
- `client`: the trainer's client of that API (retries, deadlines, per-server failures).
- `weight_stream`: the collective weight stream's wire: groups, buckets, pieces, call-offs.
- `chat`: the one prompt renderer (the model's chat template), so the token ids the trainer
  checks at start-up and previews are the ones the servers generate from.
- `registry`: the one registry style of every extension point (losses, advantages, EP backends,
  engines, rewards, tools, parsers, environments).

It imports the API models (`grpo_operator.api`) and nothing else of ours: neither side reaches
into the other through it (import-linter, `pyproject.toml`).
"""
