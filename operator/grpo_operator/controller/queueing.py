"""The Kueue protocol of queued GRPOJobs, in one place: the gate, the placement, the Workload.

Called by `controller.reconcile` three times a pass for a job labelled
`kueue.x-k8s.io/queue-name` when the operator runs with --kueue: `gate` reads the job's
Workload into an `admission.Admission` (the pure model `status.decide` applies), `placement`
gives the admitted ResourceFlavors and counts the renderer puts on the pods, and `sync` keeps
the Workload in step as Kueue's own job integrations do. The Workload's shape is
`render.kueue`'s; the protocol's state per job lives in `QueueMemory`. See docs/architecture.md.
"""

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime

from grpo_operator import render
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.api.status import TERMINAL_PHASES, Phase
from grpo_operator.controller import admission
from grpo_operator.controller.kube import Kube
from grpo_operator.controller.status import Decision, timestamp
from grpo_operator.render import kueue, names


@dataclass
class QueueMemory:
    """What the Kueue side remembers of one job between passes (lost on restart: costs reads)."""

    warned: bool = False  # the queue label was seen without --kueue (one Event)
    # ResourceFlavors of the current admission, read once per admission, not every pass.
    flavors: dict[str, kueue.FlavorPlacement] = field(default_factory=dict)


@dataclass(frozen=True)
class Gate:
    """A queued job's standing this pass: its admission, its Workload, and the priority a
    Workload still to be created gets."""

    admission: admission.Admission
    workload: dict | None
    priority: kueue.Priority | None


@dataclass(frozen=True)
class Placement:
    """What an admission adds to the render: flavors per role, and the rollout pods admitted."""

    flavors: dict[str, kueue.FlavorPlacement] | None = None
    rollout_cap: int | None = None
    warnings: tuple[str, ...] = ()


class Queueing:
    def __init__(self, kube: Kube, *, enabled: bool) -> None:
        self.kube = kube
        self.enabled = enabled

    def gate(self, body: dict, job: GRPOJob | None, memory: QueueMemory, now: datetime) -> Gate | None:
        """The job's gate, or None for a job Kueue does not queue. Without --kueue a queue
        label gets one Warning Event, and the job runs."""
        meta = body["metadata"]
        queue_name = kueue.queue_name(meta.get("labels"))
        if queue_name and not self.enabled and not memory.warned:
            memory.warned = True
            text = f"{names.KUEUE_QUEUE_LABEL}={queue_name} is ignored: the operator runs without --kueue"
            self.kube.event(body, "Warning", "KueueDisabled", text, timestamp(now))
        if not (queue_name and self.enabled and job is not None):
            return None
        workload = self.kube.get(
            kueue.API_VERSION, "Workload", meta["namespace"], names.workload(meta["name"])
        )
        standing, priority = admission.read(queue_name, workload), None
        if workload is None:
            try:
                priority = self._priority(meta, job)
            except LookupError as e:  # no Workload until it exists: the status says why
                standing = dataclasses.replace(standing, message=str(e), blocked=True)
        return Gate(standing, workload, priority)

    def placement(self, gate: Gate | None, job: GRPOJob, memory: QueueMemory, *, running: bool) -> Placement:
        """Flavors and admitted counts of a running admitted job; nothing for any other (a later
        admission may assign other flavors, so they are forgotten)."""
        if gate is None or not (gate.admission.runs and running):
            memory.flavors = {}
            return Placement()
        if not memory.flavors:
            assigned = gate.admission.flavors
            memory.flavors = {role: self._flavor(assigned.get(role, [])) for role in kueue.ROLES}
        wanted, nodes = job.spec.rollout.replicas, job.spec.rollout.nodes_per_server
        # Kueue counts pods: a server spanning nodes needs all of its own
        cap = min(wanted, gate.admission.counts.get(names.ROLE_ROLLOUT, wanted * nodes) // nodes)
        warnings = () if cap == wanted else (
            f"rollout.replicas {wanted} is more than the {cap} Kueue admitted: the rest start when "
            "the job is admitted again (suspend and resume it)",
        )  # fmt: skip
        return Placement(memory.flavors, cap, warnings)

    def sync(
        self,
        body: dict,
        job: GRPOJob,
        rendered: render.Rendered,
        gate: Gate,
        decision: Decision,
        pods: list[dict],
        now: datetime,
    ) -> None:
        """Keep the job's Workload in step: one per queued job while it wants to run, back in
        the queue after an eviction once its pods are gone, Finished when the job ends (Kueue
        frees the quota), deleted when the owner suspends it (quota and queue place returned)."""
        meta = body["metadata"]
        namespace, wl_name = meta["namespace"], names.workload(meta["name"])
        standing, workload, phase = gate.admission, gate.workload, decision.status.phase
        if phase in TERMINAL_PHASES:
            if workload is not None and not standing.finished:
                done = admission.finished(workload, phase == Phase.SUCCEEDED, decision.status.message, now)
                self.kube.patch_status_of(workload, done)
            return
        if job.spec.run_policy.suspend:
            if workload is not None:
                self.kube.delete(kueue.API_VERSION, "Workload", namespace, wl_name)
            return
        spec = job.spec
        counts = pod_counts(spec)
        if workload is None:
            if not standing.blocked:  # else the status says why
                self.kube.create(self._workload(body, rendered, standing.queue, counts, gate.priority))
        elif not standing.reserved and kueue.pod_set_counts(workload) != counts:
            # Replicas changed while queued: a new Workload asks for the new counts.
            self.kube.delete(kueue.API_VERSION, "Workload", namespace, wl_name)
        elif standing.evicted is not None and standing.reserved and not pods:
            self.kube.patch_status_of(workload, admission.cleared(workload, now))

    @staticmethod
    def _workload(
        body: dict,
        rendered: render.Rendered,
        queue: str,
        counts: dict[str, int],
        priority: kueue.Priority | None,
    ) -> dict:
        meta = body["metadata"]
        pods = [(c["metadata"]["name"], _pod_template(c)) for c in rendered.children]
        templates = {name: template for name, template in pods if template is not None}  # a PDB shares a name
        return kueue.workload(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            queue=queue,
            templates={role: templates[names.statefulset(meta["name"], role)] for role in counts},
            counts=counts,
            priority=priority,
        )

    def _flavor(self, flavor_names: list[str]) -> kueue.FlavorPlacement:
        flavors = [
            self.kube.get_cluster_scoped(kueue.API_VERSION, "resourceflavors", n) for n in flavor_names
        ]
        return kueue.flavor_placement([f for f in flavors if f is not None])

    def _priority(self, meta: dict, job: GRPOJob) -> kueue.Priority | None:
        """As Kueue's integrations resolve it: the job's WorkloadPriorityClass label, else the
        pods' PriorityClass. A class that does not exist is an error Kueue would refuse too."""
        wpc = (meta.get("labels") or {}).get(kueue.PRIORITY_LABEL)
        if wpc:
            found = self.kube.get_cluster_scoped(kueue.API_VERSION, "workloadpriorityclasses", wpc)
            group, kind, name = "kueue.x-k8s.io", "WorkloadPriorityClass", wpc
        elif job.spec.scheduling.priority_class_name:
            name = job.spec.scheduling.priority_class_name
            found = self.kube.get_cluster_scoped("scheduling.k8s.io/v1", "priorityclasses", name)
            group, kind = "scheduling.k8s.io", "PriorityClass"
        else:
            return None
        if found is None:
            raise LookupError(f"{kind} {name!r} does not exist; create it or fix the job")
        return kueue.Priority(group, kind, name, int(found.get("value", 0)))


def pod_counts(spec: GRPOJobSpec) -> dict[str, int]:
    """The pods each role asks Kueue for: a server spanning nodes is that many pods; the reward
    model servers (spec.reward.model) are a pod set of their own."""
    rollout = spec.rollout
    counts = {
        names.ROLE_TRAINER: spec.trainer.replicas,
        names.ROLE_ROLLOUT: rollout.replicas * rollout.nodes_per_server,
    }
    if spec.reward.model is not None:
        counts[names.ROLE_REWARD] = spec.reward.model.replicas
    return counts


def _pod_template(child: dict) -> dict | None:
    """The pods a child makes: a StatefulSet's template, or a LeaderWorkerSet's leader template (its
    workers ask for the same whole node); None for any other kind."""
    if child["kind"] == "StatefulSet":
        return child["spec"]["template"]
    if child["kind"] == "LeaderWorkerSet":
        return child["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    return None
