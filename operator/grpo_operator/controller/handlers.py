"""kopf registrations: one worker per GRPOJob, woken by job, pod and node watch events.

Imported (for its decorators) by `grpo-operator operator`. Each handler is a thin shell:
watch events only record what they saw and wake the job's worker; the worker runs
`Reconciler.reconcile` on the runtime's thread pool (`--workers` threads), one pass at a time
per job, so passes never race. The worker is a kopf daemon, so it stops when this replica loses
leadership (peering); it is registered without kopf's finalizer (children are garbage-collected
through their owner references, nothing needs the operator at deletion), so deleting a job or
its namespace never waits for a running operator: the worker ends when its job is gone.
"""

import asyncio
import contextlib
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import kopf

from grpo_operator.api.job import GROUP, PLURAL, VERSION
from grpo_operator.controller import metrics, observe, status
from grpo_operator.controller.reconcile import GONE, JobMemory, Reconciler
from grpo_operator.render import kueue, names

log = logging.getLogger("grpo_operator.pods")

DEBOUNCE_SECONDS = 0.2
ERROR_BACKOFF_SECONDS = 5.0  # only for a failure the reconciler could not report itself


@dataclass
class Jobs:
    """Per-job memory and wake-up events, touched only from the operator's event loop."""

    memories: dict[tuple[str, str], JobMemory] = field(default_factory=dict)
    wakers: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    generations: dict[tuple[str, str], int] = field(default_factory=dict)  # newest seen per job

    def memory(self, namespace: str, name: str) -> JobMemory:
        return self.memories.setdefault((namespace, name), JobMemory())

    def waker(self, namespace: str, name: str) -> asyncio.Event:
        return self.wakers.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: str, name: str) -> None:
        event = self.wakers.get((namespace, name))
        if event is not None:
            event.set()

    def edited(self, namespace: str, name: str, memory: JobMemory) -> bool:
        """A generation newer than the last pass saw has arrived (an edit that may fix it)."""
        newest = self.generations.get((namespace, name))
        return newest is not None and newest != memory.generation

    def wake_all(self) -> None:
        for event in self.wakers.values():
            event.set()

    def forget(self, namespace: str, name: str) -> None:
        self.memories.pop((namespace, name), None)
        self.wakers.pop((namespace, name), None)
        self.generations.pop((namespace, name), None)
        metrics.set_phase(f"{namespace}/{name}", None)


@dataclass
class Runtime:
    """What the handlers share, passed to kopf as `memo` by the CLI."""

    reconciler: Reconciler
    jobs: Jobs = field(default_factory=Jobs)
    resync_seconds: float = 60.0
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(8, "reconcile"))


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5.0)
async def job_worker(namespace: str, name: str, memo: kopf.Memo, logger: kopf.Logger, **_) -> None:
    """Reconcile this job whenever woken, and at least every resync period; end once it is gone."""
    rt: Runtime = memo.runtime
    memory, waker = rt.jobs.memory(namespace, name), rt.jobs.waker(namespace, name)
    loop = asyncio.get_running_loop()
    try:
        while True:
            waker.clear()
            try:
                delay = await loop.run_in_executor(
                    rt.executor, rt.reconciler.reconcile, namespace, name, memory
                )
            except Exception as e:  # the reconciler reports its own failures; this is a last resort
                logger.warning(
                    f"reconcile failed, retrying in {ERROR_BACKOFF_SECONDS:g}s: {type(e).__name__}: {e}"
                )
                delay = ERROR_BACKOFF_SECONDS
            if delay == GONE:
                return
            timeout = rt.resync_seconds if delay is None else min(delay, rt.resync_seconds)
            if memory.failures:  # backing off: not even the periodic resync comes sooner
                timeout = delay
            await _wait(rt, namespace, name, memory, max(timeout, DEBOUNCE_SECONDS))
            await asyncio.sleep(DEBOUNCE_SECONDS)
    finally:
        rt.jobs.forget(namespace, name)


async def _wait(rt: Runtime, namespace: str, name: str, memory: JobMemory, seconds: float) -> None:
    """Until woken or `seconds` passed. After failed passes only an edit cuts the backoff short:
    pod events and the job's own status writes (the failure report among them) do not."""
    waker, loop = rt.jobs.waker(namespace, name), asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        try:
            await asyncio.wait_for(waker.wait(), timeout=left)
        except TimeoutError:
            return
        if not memory.failures or rt.jobs.edited(namespace, name, memory):
            return
        waker.clear()


def _without_finalizer(fn: object) -> None:
    """Register `fn`'s daemon without the finalizer kopf adds for daemons by default (kopf has
    no public switch for it): deletion then never waits for the operator."""
    spawning = kopf.get_default_registry()._spawning
    spawning._handlers = [
        dataclasses.replace(h, requires_finalizer=False) if h.fn is fn else h for h in spawning._handlers
    ]


_without_finalizer(job_worker)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def job_changed(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_) -> None:
    """Spec edits (live rollout replicas, suspend) and rank 0's progress wake the worker."""
    generation = body.get("metadata", {}).get("generation")
    if generation is not None:
        memo.runtime.jobs.generations[(namespace, name)] = generation
    memo.runtime.jobs.wake(namespace, name)


@kopf.on.event(
    "", "v1", "pods", labels={names.LABEL_JOB: kopf.PRESENT, names.LABEL_MANAGED_BY: names.MANAGER}
)
async def pod_changed(
    body: kopf.Body, type: str | None, namespace: str, labels, memo: kopf.Memo, **_
) -> None:
    """Remember trainer failures (and a server pod's stated misconfiguration) before the
    StatefulSet replaces the pod, then wake the job."""
    rt: Runtime = memo.runtime
    job = labels[names.LABEL_JOB]
    pod = dict(body)
    verdict = observe.verdict(pod, rt.reconciler.lost_nodes, gone=type == "DELETED")
    kept = verdict is not None and (
        verdict.role == names.ROLE_TRAINER or status.is_server_misconfiguration(verdict)
    )
    # Only for live workers: a deleted job's pods must not leave news for a later namesake.
    if kept and (namespace, job) in rt.jobs.wakers:
        log.info("%s/%s: %s (attempt %s, %s)", namespace, job, verdict.describe(), verdict.attempt, type)
        rt.jobs.memory(namespace, job).verdicts.append(verdict)
    rt.jobs.wake(namespace, job)


def watch_workloads() -> None:
    """With --kueue: a change of a job's Kueue Workload (admitted, evicted) wakes the job.
    Registered at start, not at import, so an operator without Kueue never watches for it."""

    group, version = kueue.API_VERSION.split("/")

    @kopf.on.event(
        group,
        version,
        "workloads",
        labels={names.LABEL_JOB: kopf.PRESENT, names.LABEL_MANAGED_BY: names.MANAGER},
    )
    async def workload_changed(namespace: str, labels, memo: kopf.Memo, **_) -> None:
        memo.runtime.jobs.wake(namespace, labels[names.LABEL_JOB])


@kopf.on.event("v1", "nodes")
async def node_changed(name: str, body: kopf.Body, type: str | None, memo: kopf.Memo, **_) -> None:
    """A node that is deleted or not Ready takes its trainer pods' gang down with it."""
    rt: Runtime = memo.runtime
    conditions = body.get("status", {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    lost = type == "DELETED" or not ready
    known = name in rt.reconciler.lost_nodes
    if type == "DELETED":
        rt.reconciler.gone_nodes.add(name)
    if lost and not known:
        rt.reconciler.lost_nodes.add(name)
        rt.jobs.wake_all()
    elif known and not lost:
        rt.reconciler.lost_nodes.discard(name)
    metrics.LOST_NODES.set(len(rt.reconciler.lost_nodes))


@kopf.on.startup()
async def heartbeat(memo: kopf.Memo, **_) -> None:
    """Beat /healthz from the event loop itself: a blocked loop stops the beats."""

    async def beat() -> None:
        while True:
            metrics.HEARTBEAT.beat()
            await asyncio.sleep(5)

    memo.heartbeat = asyncio.get_running_loop().create_task(beat(), name="grpo-heartbeat")


@kopf.on.cleanup()
async def stop_heartbeat(memo: kopf.Memo, **_) -> None:
    """kopf waits 5 s for tasks it did not start before cancelling them; a SIGTERM should not."""
    task = memo.get("heartbeat")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
