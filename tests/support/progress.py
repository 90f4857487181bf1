"""One StepReport with every field set, sent by the progress, exporter, tracking and e2e status
tests: each consumer of rank 0's report is held to every field, not to the ones a test thought of."""

from grpo_operator import render
from grpo_operator.api.contract import RunContract
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.report import EvalScore, StepReport

REPORT = StepReport(
    step=3,
    max_steps=10,
    reward_mean=0.4,
    tokens_per_s=900.0,
    samples_per_s=120.0,
    samples=64,
    trained_samples=48,
    untrained_reason="each of the 16 group(s) scored all its 4 completions alike",  # a later step's words
    reward_timeouts_total=2,
    staleness=1,
    weight_version=3,
    position=24,
    step_s=0.5,
    rollout_s=0.1,
    train_s=0.3,
    push_s=0.1,
    rollout_wait_fraction=0.2,
    ep_all_to_all_s=0.05,
    ep_backend="nccl",
    ep_candidates={"nccl": "1.200 ms", "deepep_v1": "failed: rank 3: RuntimeError: no NVLink"},
    time=1.7e9,
    last_checkpoint="/ckpt/step-00000002",
    last_checkpoint_step=2,
    resumed_from_step=1,
    resumed_from="s3://b/ck/ns/j-u/step-00000001",
    checkpoint_warning="checkpoint /ckpt/step-00000002 is unreadable; falling back",
    metrics={
        "loss": 0.25,
        "grad_norm": 1.5,
        "kept": 0.75,
        "episodes_cut_fraction": 0.25,
        "reward_timeouts": 2.0,
    },
    evals=[  # the baseline rides on the first report; this one also carries the step's own
        EvalScore(step=0, reward=0.1, pass_at_k=0.5, k=4, prompts=20, seconds=1.0),
        EvalScore(step=3, reward=0.3, pass_at_k=0.75, k=4, prompts=20, seconds=1.0),
    ],
)


def progress_contract() -> RunContract:
    """A small job's run contract, for a ProgressReporter outside a cluster."""
    spec = {
        "model": {"path": "/m"},
        "dataset": {"path": "/d.jsonl"},
        "reward": {"functions": [{"builtin": "math"}]},
    }
    job = GRPOJob.model_validate(
        {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "j"}, "spec": spec}
    )
    return render.contract(job, name="j", namespace="ns", local_ports=render.LocalPorts(1, (2,)))
