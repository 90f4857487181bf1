"""Generation engines behind one small Protocol (`grpo_rollout.engines.base`), chosen by name."""
