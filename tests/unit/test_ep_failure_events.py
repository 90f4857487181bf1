"""A failed `epBackend: auto` candidate: the trainer's report carries it into status.progress, and
the operator announces each one once (Event text, and what it has already announced)."""

from grpo_operator.api.report import StepReport
from grpo_operator.api.status import Progress
from grpo_operator.controller import ep_failures


def report(candidates: dict[str, str]) -> StepReport:
    return StepReport(
        step=1,
        max_steps=2,
        reward_mean=None,
        tokens_per_s=None,
        samples_per_s=None,
        samples=0,
        staleness=0,
        weight_version=1,
        position=0,
        step_s=1.0,
        rollout_s=0.5,
        train_s=0.5,
        push_s=0.0,
        time=0.0,
        ep_backend="alltoall",
        ep_candidates=candidates,
    )


def test_failed_candidates_reach_the_status_with_their_reasons():
    why = "RuntimeError: NCCL GIN is unavailable"
    progress = report({"alltoall": "1.250 ms", "deepep_v2": f"failed: {why}"})
    assert progress.to_progress().ep_backend_failures == {"deepep_v2": why}
    assert report({"alltoall": "1.250 ms"}).to_progress().ep_backend_failures == {}
    long = report({"deepep_v1": "failed: " + "x" * 5000}).to_progress()
    assert len(long.ep_backend_failures["deepep_v1"]) == 1024


def test_each_failure_is_announced_once_and_a_new_reason_is_news():
    progress = Progress(ep_backend_failures={"deepep_v2": "init raised", "deepep_v1": "spans nodes"})
    first = ep_failures.fresh(progress, set())
    assert first == [("deepep_v1", "spans nodes"), ("deepep_v2", "init raised")]
    assert ep_failures.fresh(progress, set(first)) == []
    changed = Progress(ep_backend_failures={"deepep_v2": "round trip timed out"})
    assert ep_failures.fresh(changed, set(first)) == [("deepep_v2", "round trip timed out")]
    assert ep_failures.fresh(None, set()) == []
    kind, reason, message = ep_failures.event(("deepep_v2", "init raised"))
    assert (kind, reason) == ("Warning", "EPBackendFailed")
    assert "deepep_v2" in message and "init raised" in message


def test_the_status_says_why_auto_chose_its_backend():
    candidates = {
        "alltoall": "1.250 ms",
        "deepep_v1": "skipped: rank 0: the EP group spans 2 nodes",
        "deepep_v2": "failed: rank 3: RuntimeError: NCCL GIN is unavailable",
    }
    progress = report(candidates).to_progress()
    assert progress.ep_backend == "alltoall" and progress.ep_backend_candidates == candidates
    assert progress.ep_backend_failures == {"deepep_v2": "rank 3: RuntimeError: NCCL GIN is unavailable"}
    assert "epBackendCandidates" in progress.wire()  # the field the API server stores
