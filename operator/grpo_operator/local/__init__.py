"""The local runtime: a GRPOJob's pods, rendered by the operator's renderer, run as local processes.

`grpo-operator run` (grpo_operator.cli.run) is its entry point; `plan` renders and localizes
the pods, `procs` runs them as process groups, `supervisor` restarts and stops them as the
operator would, `progress` and `display` report what the trainer does.
"""
