"""Unit tests of the pure lifecycle (controller.status) and pod verdicts (controller.observe)."""

from datetime import timedelta

from grpo_operator.api.roles import RolloutAutoscaling
from grpo_operator.api.status import GRPOJobStatus, Phase, Progress, Reason
from grpo_operator.controller import observe, placement, status

from tests.support.status import NOW, all_ready, cond, decide, pod, spec


def test_phases_follow_the_pods():
    pending = pod("trainer", 0, node=None, ready=False)
    pending["status"]["conditions"].append(
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/9 nodes: no GPU"}
    )
    d = decide([pending])
    assert d.status.phase == Phase.PENDING and d.running
    assert d.status.message.endswith("unschedulable j-trainer-0: 0/9 nodes: no GPU")
    assert d.status.observed_generation == 3 and d.status.start_time == "2026-01-01T12:00:00Z"
    starting = [pod(r, i, ready=False) for r in ("trainer", "rollout") for i in range(2)]
    assert decide(starting, old=d.status).status.phase == Phase.STARTING
    d2 = decide(all_ready(), old=d.status)
    assert d2.status.phase == Phase.RUNNING
    assert d2.status.trainer.ready_text == "2/2" and d2.status.rollout.ready == 2
    assert cond(d2.status, "Running").status == "True"
    assert d2.events and d2.events[0][1] == Reason.ALL_READY


def test_unchanged_world_gives_identical_status_and_no_events():
    first = decide(all_ready())
    again = decide(all_ready(), old=first.status, now=NOW + timedelta(minutes=5))
    assert again.status == first.status
    assert again.events == []


def test_trainer_failure_restarts_the_gang_and_counts():
    running = decide(all_ready()).status
    pods = all_ready()
    pods[1] = pod("trainer", 1, phase="Failed", term=1, ready=False)
    d = decide(pods, old=running)
    assert d.gang_restart and d.running
    assert d.status.restarts == 1 and d.status.phase == Phase.RESTARTING
    assert "trainer pod j-trainer-1 failed with exit code 1" in d.status.message
    assert d.events[0][0] == "Warning" and d.events[0][1] == Reason.TRAINER_FAILED
    # the old gang's pods are stale now; the new gang is not ready yet: still Restarting
    assert decide(pods, old=d.status).status.phase == Phase.RESTARTING
    back = decide(all_ready(attempt=1), old=d.status)
    assert back.status.phase == Phase.RUNNING and back.status.restarts == 1
    assert cond(back.status, "Restarting").status == "False"


def test_backoff_limit_fails_with_reason():
    old = GRPOJobStatus(phase=Phase.RUNNING, restarts=2, progress=Progress(step=7))
    pods = [pod("trainer", 0, attempt=2, phase="Failed", term=137)]
    d = decide(pods, old=old, s=spec(backoffLimit=2))
    assert d.status.phase == Phase.FAILED and not d.running and not d.gang_restart
    failed = cond(d.status, "Failed")
    assert failed.reason == Reason.BACKOFF_LIMIT_EXCEEDED and "backoffLimit=2" in failed.message
    assert "j-trainer-0 failed with exit code 137 [ranks 0-0, after step 7]" in failed.message


def test_permanent_exit_code_fails_at_once():
    d = decide([pod("trainer", 1, phase="Failed", term=78)], old=GRPOJobStatus(phase=Phase.RUNNING))
    assert d.status.phase == Phase.FAILED and d.status.restarts == 0
    assert cond(d.status, "Failed").reason == Reason.PERMANENT_ERROR


def test_rank_zero_exit_zero_succeeds_and_stops_pods():
    d = decide(
        [pod("trainer", 0, term=0, ready=False), pod("trainer", 1)], old=GRPOJobStatus(phase=Phase.RUNNING)
    )
    assert d.status.phase == Phase.SUCCEEDED and not d.running
    assert d.status.completion_time == "2026-01-01T12:00:00Z"


def test_rollout_failure_does_not_touch_the_gang():
    pods = all_ready()
    pods[3] = pod("rollout", 1, phase="Failed", term=1, ready=False)
    obs = observe.summarize(pods, attempt=0)
    assert obs.failed_rollout_pods == ["j-rollout-1"]
    d = decide(pods, old=decide(all_ready()).status)
    assert not d.gang_restart and d.status.phase == Phase.RUNNING and d.status.rollout.ready == 1


def test_stale_attempt_pods_are_listed_and_ignored():
    obs = observe.summarize(
        [pod("trainer", 0, attempt=0, phase="Failed", term=1), pod("trainer", 0, attempt=1)], attempt=1
    )
    assert obs.stale_trainer_pods == ["j-trainer-0"] and obs.verdicts == [] and obs.trainer.ready == 1


def test_node_loss_and_deletion_are_failures():
    v = observe.verdict(pod("trainer", 1, node="p5-3"), {"p5-3"})
    assert v.kind == "node-lost"
    d = decide([pod("trainer", 0), pod("trainer", 1, node="gone")], old=GRPOJobStatus(phase=Phase.RUNNING))
    assert not d.gang_restart
    obs = observe.summarize(
        [pod("trainer", 0), pod("trainer", 1, node="p5-3")], attempt=0, lost_nodes={"p5-3"}
    )
    d = status.decide(spec=spec(), generation=1, old=GRPOJobStatus(phase=Phase.RUNNING), obs=obs, now=NOW)
    assert d.gang_restart and cond(d.status, "Restarting").reason == Reason.NODE_LOST
    assert observe.verdict(pod("trainer", 1, deleting=True)).kind == "deleted"


def test_a_pod_deleted_before_it_was_scheduled_is_no_failure():
    """No rank ran in it and its StatefulSet makes it again: seen on the e2e fleet, a new
    attempt's Pending pod deleted within a second of its creation took the gang's last restart."""
    assert observe.verdict(pod("trainer", 1, node=None, phase="Pending", ready=False, deleting=True)) is None
    assert observe.verdict(pod("trainer", 1, node=None, phase="Pending", ready=False), gone=True) is None
    assert observe.verdict(pod("trainer", 1), gone=True).kind == "deleted"  # the watch's DELETED event
    obs = observe.summarize([pod("trainer", 0), pod("trainer", 1, node=None, deleting=True)], attempt=0)
    d = status.decide(spec=spec(), generation=1, old=GRPOJobStatus(phase=Phase.RUNNING), obs=obs, now=NOW)
    assert not d.gang_restart and d.status.phase != Phase.FAILED


def test_suspend_removes_pods_and_resume_restarts_clock():
    running = decide(all_ready()).status
    d = decide(all_ready(), old=running, s=spec(suspend=True))
    assert d.status.phase == Phase.SUSPENDED and not d.running and d.status.start_time is None
    assert cond(d.status, "Suspended").reason == Reason.SUSPENDED
    later = NOW + timedelta(hours=1)
    resumed = decide([], old=d.status, now=later)
    assert resumed.running and resumed.status.phase == Phase.PENDING
    assert cond(resumed.status, "Suspended").status == "False"
    assert resumed.status.start_time == status.timestamp(later)


def test_active_deadline():
    old = GRPOJobStatus(phase=Phase.RUNNING, start_time="2026-01-01T11:00:00Z")
    d = decide(all_ready(), old=old, s=spec(activeDeadlineSeconds=7200))
    assert d.status.phase == Phase.RUNNING and d.requeue_after == 3600
    d = decide(all_ready(), old=old, s=spec(activeDeadlineSeconds=3600))
    assert d.status.phase == Phase.FAILED and cond(d.status, "Failed").reason == Reason.DEADLINE_EXCEEDED


def test_ttl_after_finished():
    done = GRPOJobStatus(phase=Phase.SUCCEEDED, completion_time="2026-01-01T11:59:00Z")
    d = decide([], old=done, s=spec(ttlSecondsAfterFinished=120))
    assert not d.delete_job and d.requeue_after == 60 and d.status.phase == Phase.SUCCEEDED
    assert decide([], old=done, s=spec(ttlSecondsAfterFinished=60)).delete_job


def test_invalid_spec_fails_with_message():
    d = status.decide(
        spec=None,
        generation=1,
        old=GRPOJobStatus(),
        obs=observe.Observation(),
        now=NOW,
        spec_error=status.SpecError(Reason.INVALID_SPEC, "bad type"),
    )
    assert d.status.phase == Phase.FAILED and cond(d.status, "Failed").message == "bad type"
    assert d.events == [("Warning", Reason.INVALID_SPEC, "New → Failed: bad type")]


def node(name: str, zone: str, ready: bool = True, cordoned: bool = False) -> dict:
    return {
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
        "spec": {"unschedulable": cordoned},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def test_gang_zone_is_one_that_holds_the_whole_gang():
    fleet = [node("b0", "us-west-2b"), node("a0", "us-west-2a"), node("a1", "us-west-2a")]
    assert placement.choose_zone(fleet, replicas=2) == "us-west-2a"
    # not-ready and cordoned nodes do not count; ties go to the first name
    fleet += [
        node("b1", "us-west-2b"),
        node("b2", "us-west-2b", ready=False),
        node("a2", "us-west-2a", cordoned=True),
    ]
    assert placement.choose_zone(fleet, replicas=2) == "us-west-2a"
    assert placement.choose_zone([*fleet, node("b3", "us-west-2b")], replicas=2) == "us-west-2b"
    assert placement.choose_zone([node("c0", "us-east-1c")], replicas=4) == "us-east-1c"
    assert placement.choose_zone([], replicas=2) is None


def test_zone_of_running_gang_is_read_back_only_for_its_attempt():
    def sts(attempt: str, selector: dict, replicas: int = 2) -> dict:
        template = {"metadata": {"labels": {"grpo.dev/attempt": attempt}}, "spec": {"nodeSelector": selector}}
        return {"spec": {"replicas": replicas, "template": template}}

    zoned = {"topology.kubernetes.io/zone": "us-west-2a", "node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert placement.zone_of_running_gang(sts("1", zoned), attempt=1) == (True, "us-west-2a")
    # rendered before any node had a zone (Karpenter): stays without one
    assert placement.zone_of_running_gang(sts("1", {}), attempt=1) == (True, None)
    assert placement.zone_of_running_gang(sts("0", zoned), attempt=1) == (False, None)  # a new attempt
    assert placement.zone_of_running_gang(None, attempt=0) == (False, None)
    # rendered at zero replicas while queued or suspended: no pods, the zone is still to choose
    assert placement.zone_of_running_gang(sts("1", {}, replicas=0), attempt=1) == (False, None)


def test_a_sidecar_exit_is_not_a_trainer_failure():
    p = pod("trainer", 1)
    p["status"]["containerStatuses"] = [
        {"name": "trainer", "state": {"running": {}}},
        {"name": "log-shipper", "lastState": {"terminated": {"exitCode": 2}}, "state": {"running": {}}},
    ]
    assert observe.verdict(p) is None
    p["status"]["containerStatuses"][0]["lastState"] = {
        "terminated": {"exitCode": 137, "reason": "OOMKilled"}
    }
    v = observe.verdict(p)
    assert (v.kind, v.exit_code, v.reason) == ("failed", 137, "OOMKilled")


def test_a_refused_live_edit_keeps_the_job_running_on_its_last_spec_and_says_so_once():
    running = decide(all_ready()).status
    error = status.SpecError(Reason.INVALID_SPEC, "rollout.instanceType: unknown instance type 'p9.bogus'")
    d = decide(all_ready(), old=running, spec_error=error)  # `spec` is the last one that ran
    assert d.running and d.status.phase == Phase.RUNNING and not d.gang_restart
    rejected = cond(d.status, "UpdateRejected")
    assert rejected.status == "True" and rejected.reason == "InvalidSpec"
    assert rejected.message.startswith("generation 3 not applied, the job runs on as before: rollout.")
    assert [e[:2] for e in d.events] == [("Warning", "InvalidSpec")]
    again = decide(all_ready(), old=d.status, spec_error=error)
    assert again.events == []  # one Event per refusal, not per pass
    fixed = decide(all_ready(), old=again.status)
    assert cond(fixed.status, "UpdateRejected").status == "False" and fixed.events == []


def test_a_refused_edit_without_the_last_spec_changes_nothing_but_the_condition():
    running = decide(all_ready()).status
    error = status.SpecError(Reason.ESCALATION_REFUSED, "spec.network.privileged: needs approval")
    d = status.rejected_update(running, 4, error, NOW)
    assert d.status.phase == Phase.RUNNING and d.status.restarts == running.restarts
    assert cond(d.status, "UpdateRejected").reason == "EscalationNotApproved"
    assert d.events == [("Warning", "EscalationNotApproved", cond(d.status, "UpdateRejected").message)]


def test_a_job_that_bypassed_admission_fails_with_the_refusal():
    error = status.SpecError(Reason.ESCALATION_REFUSED, "spec.trainer.template.spec.hostPID: host namespaces")
    d = status.decide(spec=None, generation=1, old=GRPOJobStatus(), obs=observe.Observation(), now=NOW,
                      spec_error=error)  # fmt: skip
    assert d.status.phase == Phase.FAILED and not d.running
    assert cond(d.status, "Failed").reason == "EscalationNotApproved"
    assert d.events[0][0] == "Warning"


def test_a_failed_pass_is_a_condition_until_a_pass_succeeds():
    st = decide(all_ready()).status
    status.failed_pass(st, "ChildConflict", "ServiceAccount j-trainer is not ours", NOW)
    assert cond(st, "ReconcileError").status == "True" and st.message.endswith("is not ours")
    status.recovered(st, NOW)
    assert cond(st, "ReconcileError").status == "False"
    clean = decide(all_ready()).status
    status.recovered(clean, NOW)
    assert not [c for c in clean.conditions if c.type == "ReconcileError"]  # never set: not listed


def test_autoscaling_moves_the_rollout_count_in_status_never_in_spec():
    job = spec()
    job.rollout.min_replicas, job.rollout.max_replicas = 1, 6
    job.rollout.autoscaling = RolloutAutoscaling(target_wait_fraction=0.1, scale_up_cooldown_seconds=0)
    first = decide(all_ready(), s=job)
    assert first.status.rollout.replicas == 2 and first.status.rollout_scaling.reason == "Started"
    waiting = first.status.model_copy(deep=True)
    waiting.progress = Progress(step=3, rollout_wait_fraction=0.3, updated_at="2026-01-01T11:59:50+00:00")
    d = decide(all_ready(), old=waiting, s=job)
    assert d.status.rollout.replicas == 4 and d.status.rollout.ready_text == "2/4"
    assert d.status.rollout_scaling.reason == "TrainerWaiting"
    assert d.status.rollout_scaling.last_scale_time == "2026-01-01T12:00:00Z"
    assert ("Normal", "TrainerWaiting") in [e[:2] for e in d.events]
    assert job.rollout.replicas == 2  # the spec is the starting count only
    plain = decide(all_ready(), old=d.status)  # autoscaling switched off: the spec decides again
    assert plain.status.rollout.replicas == 2 and plain.status.rollout_scaling is None
