"""The `epBackend: auto` choice: the trainer's attempt-start record (before the first step) and step
reports carry it into status.progress, and the operator announces it once: the choice and each
failed candidate as Events, failed and skipped candidates counted."""

from grpo_operator.api.report import AttemptStart, StepReport
from grpo_operator.api.status import Progress
from grpo_operator.controller import ep_backend


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
        ep_backend="nccl",
        ep_candidates=candidates,
    )


def test_failed_candidates_reach_the_status_with_their_reasons():
    why = "RuntimeError: NCCL GIN is unavailable"
    progress = report({"nccl": "1.250 ms", "deepep_v2": f"failed: {why}"})
    assert progress.to_progress().ep_backend_failures == {"deepep_v2": why}
    assert report({"nccl": "1.250 ms"}).to_progress().ep_backend_failures == {}
    long = report({"deepep_v1": "failed: " + "x" * 5000}).to_progress()
    assert len(long.ep_backend_failures["deepep_v1"]) == 1024


def test_each_failure_is_announced_once_and_a_new_reason_is_news():
    progress = Progress(ep_backend_failures={"deepep_v2": "init raised", "deepep_v1": "spans nodes"})
    first = ep_backend.fresh(progress, set())
    assert first == [
        ("EPBackendFailed", "deepep_v1", "spans nodes"),
        ("EPBackendFailed", "deepep_v2", "init raised"),
    ]
    assert ep_backend.fresh(progress, set(first)) == []
    changed = Progress(ep_backend_failures={"deepep_v2": "round trip timed out"})
    assert ep_backend.fresh(changed, set(first)) == [("EPBackendFailed", "deepep_v2", "round trip timed out")]
    assert ep_backend.fresh(None, set()) == []
    kind, reason, message = ep_backend.event(("EPBackendFailed", "deepep_v2", "init raised"))
    assert (kind, reason) == ("Warning", "EPBackendFailed")
    assert "deepep_v2" in message and "init raised" in message


CANDIDATES = {
    "nccl": "1.250 ms",
    "deepep_v1": "skipped: rank 0: the EP group spans 2 nodes",
    "deepep_v2": "skipped: deep_ep does not import (AssertionError: Duplicate NCCL runtime)",
}


def test_the_choice_is_in_the_status_before_the_first_step_with_every_candidates_reason():
    start = AttemptStart(ep_backend="nccl", ep_candidates=CANDIDATES, time=0.0)
    patch = start.to_progress_patch()
    assert patch["epBackend"] == "nccl" and patch["epBackendCandidates"] == CANDIDATES
    assert patch["epBackendFailures"] == {} and patch["resumedFromStep"] is None
    progress = Progress.model_validate(patch)  # what the operator reads back from the status
    assert progress.ep_backend == "nccl" and progress.ep_backend_candidates == CANDIDATES
    assert "EP backend nccl" in start.describe() and "Duplicate NCCL runtime" in start.describe()
    assert "epBackend" not in AttemptStart(time=0.0).to_progress_patch()  # not auto: nothing to say


def test_the_choice_is_an_event_naming_each_candidate_and_each_refusal_is_counted_once():
    progress = Progress(ep_backend="nccl", ep_backend_candidates=CANDIDATES)
    news = ep_backend.fresh(progress, set())
    assert [k for k, _, _ in news] == ["EPBackendChosen", "refused", "refused"]
    kind, reason, message = ep_backend.event(news[0])
    assert (kind, reason) == ("Normal", "EPBackendChosen")
    assert "nccl" in message and "1.250 ms" in message and "Duplicate NCCL runtime" in message
    assert [ep_backend.event(n) for n in news[1:]] == [None, None]  # counted, no Event each
    assert {b for k, b, _ in news if k == "refused"} == {"deepep_v1", "deepep_v2"}
    assert ep_backend.fresh(progress, set(news)) == []  # every step repeats it: announced once


def test_the_status_says_why_auto_chose_its_backend():
    candidates = {
        "nccl": "1.250 ms",
        "deepep_v1": "skipped: rank 0: the EP group spans 2 nodes",
        "deepep_v2": "failed: rank 3: RuntimeError: NCCL GIN is unavailable",
    }
    progress = report(candidates).to_progress()
    assert progress.ep_backend == "nccl" and progress.ep_backend_candidates == candidates
    assert progress.ep_backend_failures == {"deepep_v2": "rank 3: RuntimeError: NCCL GIN is unavailable"}
    assert "epBackendCandidates" in progress.wire()  # the field the API server stores
