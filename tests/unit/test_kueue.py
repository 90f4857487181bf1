"""The Kueue integration's pure parts: the Workload a queued job asks with, how a Workload's
status gates the job, and the status the operator writes back (Kueue's jobframework protocol)."""

from datetime import UTC, datetime, timedelta

from grpo_operator.api.job import GRPOJob
from grpo_operator.api.status import Phase, Reason
from grpo_operator.controller import admission
from grpo_operator.render import kueue, names, render

from tests.support.status import all_ready, cond, decide

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def job() -> GRPOJob:
    return GRPOJob.model_validate(
        {
            "apiVersion": "grpo.dev/v1alpha1",
            "kind": "GRPOJob",
            "metadata": {"name": "q"},
            "spec": {
                "model": {"path": "/m"},
                "dataset": {"path": "/d"},
                "reward": {"functions": [{"builtin": "math"}]},
                "trainer": {"replicas": 2, "instanceType": "p5.48xlarge", "processesPerPod": 8},
                "rollout": {"replicas": 3, "instanceType": "p5.48xlarge", "tensorParallelSize": 8},
            },
        }
    )


def templates(**kw) -> dict[str, dict]:
    out = render(job(), name="q", namespace="ml", uid="u-1", **kw)
    return {
        role: next(
            c
            for c in out.children
            if c["kind"] == "StatefulSet" and c["metadata"]["name"] == names.statefulset("q", role)
        )
        for role in (names.ROLE_TRAINER, names.ROLE_ROLLOUT)
    }


def wl_templates(sts: dict[str, dict]) -> dict[str, dict]:
    return {r: s["spec"]["template"] for r, s in sts.items()}


def condition(
    kind: str, status: bool, reason: str = "R", message: str = "", when: str = "2026-01-01T11:00:00Z"
):
    state = "True" if status else "False"
    return {"type": kind, "status": state, "reason": reason, "message": message, "lastTransitionTime": when}


def workload(conditions=(), admission_=None) -> dict:
    status = {"conditions": list(conditions)}
    if admission_ is not None:
        status["admission"] = admission_
    meta = {"name": "grpojob-q", "namespace": "ml", "generation": 1, "resourceVersion": "7"}
    return {"apiVersion": kueue.API_VERSION, "kind": "Workload", "metadata": meta, "status": status}


ADMISSION = {
    "clusterQueue": "cq",
    "podSetAssignments": [
        {"name": "trainer", "flavors": {"nvidia.com/gpu": "p5", "cpu": "p5"}, "count": 2},
        {"name": "rollout", "flavors": {"nvidia.com/gpu": "p5"}, "count": 2},
    ],
}


def test_workload_asks_for_each_role_with_its_real_pod_template():
    sts = templates()
    wl = kueue.workload(
        name="q",
        namespace="ml",
        uid="u-1",
        queue="team-a",
        templates=wl_templates(sts),
        counts={"trainer": 2, "rollout": 3},
    )
    assert wl["metadata"]["name"] == "grpojob-q" and wl["spec"]["queueName"] == "team-a"
    assert wl["metadata"]["ownerReferences"][0]["controller"] is True
    assert kueue.pod_set_counts(wl) == {"trainer": 2, "rollout": 3}
    trainer = wl["spec"]["podSets"][0]["template"]["spec"]
    assert trainer["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32"
    assert trainer["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    assert "priority" not in wl["spec"]
    gold = kueue.Priority("kueue.x-k8s.io", "WorkloadPriorityClass", "gold", 1000)
    ranked = kueue.workload(
        name="q",
        namespace="ml",
        uid="u-1",
        queue="team-a",
        templates=wl_templates(sts),
        counts={"trainer": 1, "rollout": 1},
        priority=gold,
    )
    assert ranked["spec"]["priority"] == 1000
    assert ranked["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io",
        "kind": "WorkloadPriorityClass",
        "name": "gold",
    }


def test_flavor_adds_labels_and_tolerations_and_reports_a_conflict():
    placement = kueue.flavor_placement(
        [
            {
                "spec": {
                    "nodeLabels": {"pool": "reserved", "node.kubernetes.io/instance-type": "p5en.48xlarge"}
                }
            },
            {"spec": {"tolerations": [{"key": "reserved", "operator": "Exists", "effect": "NoSchedule"}]}},
        ]
    )
    sts = templates(flavors={"trainer": placement})
    pod = sts["trainer"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["pool"] == "reserved"
    assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"  # the job's wins
    assert {"key": "reserved", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert "pool" not in (sts["rollout"]["spec"]["template"]["spec"].get("nodeSelector") or {})
    out = render(job(), name="q", namespace="ml", uid="u-1", flavors={"trainer": placement})
    assert any("instance-type=p5.48xlarge kept over Kueue flavor's p5en.48xlarge" in w for w in out.warnings)


def test_admitted_counts_cap_the_rollout():
    assert templates(rollout_replicas=2)["rollout"]["spec"]["replicas"] == 2
    assert templates(rollout_replicas=2, running=False)["rollout"]["spec"]["replicas"] == 0


def test_a_workload_gates_the_job_until_admitted_and_after_an_eviction():
    assert not admission.read("team-a", None).runs
    pending = admission.read(
        "team-a", workload([condition("QuotaReserved", False, "Pending", "no GPU quota left")])
    )
    assert not pending.runs and not pending.reserved
    assert (
        pending.why_waiting() == "waiting for Kueue to admit it from LocalQueue 'team-a': no GPU quota left"
    )
    admitted = admission.read(
        "team-a", workload([condition("QuotaReserved", True), condition("Admitted", True)], ADMISSION)
    )
    assert admitted.runs and admitted.flavors == {"trainer": ["p5"], "rollout": ["p5"]}
    assert admitted.counts == {"trainer": 2, "rollout": 2}
    evicted = admission.read(
        "team-a",
        workload(
            [condition("Admitted", True), condition("Evicted", True, "Preempted", "preempted")], ADMISSION
        ),
    )
    assert not evicted.runs and evicted.reserved and evicted.why_waiting() == "evicted by Kueue: preempted"


def test_status_decision_follows_the_gate():
    gate = admission.read("team-a", workload([condition("QuotaReserved", False, "Pending", "full")]))
    d = decide(all_ready(), queue=gate)
    assert d.status.phase == Phase.SUSPENDED and not d.running
    assert cond(d.status, "Suspended").reason == Reason.AWAITING_ADMISSION
    ok = admission.read(
        "team-a", workload([condition("QuotaReserved", True), condition("Admitted", True)], ADMISSION)
    )
    again = decide(all_ready(), old=d.status, queue=ok)
    assert again.running and again.status.phase == Phase.RUNNING
    assert cond(again.status, "Suspended").status == "False"


def test_cleared_status_hands_an_evicted_workload_back_to_the_queue():
    for reason, requeued in (("Preempted", "True"), ("InactiveWorkload", "False")):
        wl = workload([condition("Admitted", True), condition("Evicted", True, reason, "why")], ADMISSION)
        body = admission.cleared(wl, NOW)
        kinds = {c["type"]: c for c in body["conditions"]}
        assert body["admission"] is None
        assert (kinds["QuotaReserved"]["status"], kinds["QuotaReserved"]["reason"]) == ("False", "Pending")
        assert kinds["Admitted"]["status"] == "False" and kinds["Requeued"]["status"] == requeued
        assert kinds["Evicted"]["status"] == "True"  # Kueue's own condition stays


def test_finished_status_keeps_transition_times_of_unchanged_conditions():
    wl = workload(
        [condition("Admitted", True), condition("Finished", True, "Succeeded", "", "2026-01-01T10:00:00Z")]
    )
    later = NOW + timedelta(hours=1)
    kinds = {c["type"]: c for c in admission.finished(wl, False, "trainer failed", later)["conditions"]}
    assert kinds["Finished"]["lastTransitionTime"] == "2026-01-01T10:00:00Z"  # still True
    assert kinds["Finished"]["reason"] == "Failed" and kinds["Finished"]["message"] == "trainer failed"
    fresh = workload([condition("Admitted", True)])
    kinds = {c["type"]: c for c in admission.finished(fresh, True, "done", later)["conditions"]}
    assert (
        kinds["Finished"]["status"] == "True"
        and kinds["Finished"]["lastTransitionTime"] == "2026-01-01T13:00:00Z"
    )


def test_the_operators_workload_carries_each_roles_template_and_counts_pods_of_spanning_servers():
    """What `Queueing` sends: a template per role taken from the rendered children (never the PDB or
    Service that share a StatefulSet's name), and for servers spanning nodes the leader's template
    and servers x nodesPerServer pods."""
    from grpo_operator.controller.queueing import Queueing, pod_counts

    from tests.support.render import job, rendered

    body = {"metadata": {"name": "moe", "namespace": "team", "uid": "uid-1"}}
    spanning = {"replicas": 3, "instanceType": "p5en.48xlarge", "nodesPerServer": 2, "tensorParallelSize": 1}
    spanning["vllm"] = {"dataParallelSize": 16, "expertParallelSize": 16}
    for spec, rollout_pods in ((job(), 2), (job(rollout=spanning), 6)):
        counts = pod_counts(spec.spec)
        assert counts == {"trainer": 2, "rollout": rollout_pods}
        wl = Queueing._workload(body, rendered(spec), "team-a", counts, None)
        sets = {ps["name"]: ps for ps in wl["spec"]["podSets"]}
        assert sets["rollout"]["count"] == rollout_pods
        for role in ("trainer", "rollout"):
            container = sets[role]["template"]["spec"]["containers"][0]
            assert container["name"] == role and container["resources"]["limits"]["nvidia.com/gpu"] == "8"
