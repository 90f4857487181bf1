"""Prometheus metrics of the operator and the `/metrics` + `/healthz` HTTP endpoint.

Counters are bumped by `controller.kube` (API writes) and `controller.reconcile`; the
server is started by `grpo-operator operator --metrics-port`. `/healthz` answers 200 while
the operator's event loop is alive (it beats a heartbeat) and no reconcile pass is stuck, and
503 otherwise, so the liveness probe restarts a wedged operator.
"""

import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from grpo_operator.api.status import Phase

RECONCILES = Counter("grpo_operator_reconciles_total", "Reconcile passes of GRPOJobs.", ["result"])
RECONCILE_ERRORS = Counter("grpo_operator_reconcile_errors_total", "Reconcile passes that raised.")
RECONCILE_SECONDS = Histogram(
    "grpo_operator_reconcile_duration_seconds",
    "Duration of one reconcile pass.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
JOBS = Gauge("grpo_operator_jobs", "GRPOJobs seen by this operator, by phase.", ["phase"])
LOST_NODES = Gauge("grpo_operator_lost_nodes", "Nodes seen deleted or not Ready (their gangs restart).")
GANG_RESTARTS = Counter("grpo_operator_gang_restarts_total", "Trainer gang restarts performed.")
API_WRITES = Counter(
    "grpo_operator_api_writes_total", "Write requests sent to the API server.", ["verb", "kind"]
)
EP_BACKEND_FAILURES = Counter(
    "grpo_operator_ep_backend_failures_total",
    "epBackend auto candidates that failed in a trainer gang (each reported failure counted once).",
    ["backend"],
)
EP_BACKEND_REFUSED = Counter(
    "grpo_operator_ep_backend_refused_total",
    "epBackend auto candidates a trainer gang skipped, refused by its layout or installed library "
    "(e.g. DeepEP not importable; each reported refusal counted once).",
    ["backend"],
)
SIGNAL_WARNINGS = Counter(
    "grpo_operator_signal_warnings_total",
    "Jobs warned that their learning signal is wrong (api.signals: RewardTimeouts, EpisodesCutByBudget), "
    "once per job and reason.",
    ["reason"],
)


class Heartbeat:
    """Beaten by the operator's loop; stale beats make /healthz fail so a liveness probe restarts us."""

    def __init__(self, stale_after: float = 60.0) -> None:
        self.stale_after = stale_after
        self.last = time.monotonic()

    def beat(self) -> None:
        self.last = time.monotonic()

    def healthy(self) -> bool:
        return time.monotonic() - self.last < self.stale_after


class PassWatch:
    """Reconcile passes in flight; one running longer than `stuck_after` makes /healthz fail.

    Every API call has a timeout (`controller.kube`), so a pass that runs this long is stuck
    (a black-holed connection, a deadlock), and a restart is the cure."""

    def __init__(self, stuck_after: float = 300.0) -> None:
        self.stuck_after = stuck_after
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def running(self, key: str) -> Iterator[None]:
        with self._lock:
            self._started[key] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._started.pop(key, None)

    def stuck(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return sorted(k for k, t in self._started.items() if now - t > self.stuck_after)


HEARTBEAT = Heartbeat()
PASSES = PassWatch()
_PHASES: dict[str, str] = {}
_PHASES_LOCK = threading.Lock()


def set_phase(key: str, phase: str | None) -> None:
    """Record a job's phase (None when the job is gone) and refresh the by-phase gauge."""
    with _PHASES_LOCK:
        if phase is None:
            _PHASES.pop(key, None)
        else:
            _PHASES[key] = phase
        for p in Phase:
            JOBS.labels(phase=p.value).set(sum(1 for v in _PHASES.values() if v == p))


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.startswith("/metrics"):
            body, code, ctype = generate_latest(), 200, CONTENT_TYPE_LATEST
        elif self.path.startswith("/healthz"):
            stuck = PASSES.stuck()
            ok = HEARTBEAT.healthy() and not stuck
            text = "ok\n" if ok else f"stuck: {', '.join(stuck) or 'event loop'}\n"
            body, code, ctype = text.encode(), (200 if ok else 503), "text/plain"
        else:
            body, code, ctype = b"not found\n", 404, "text/plain"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # scrapes every few seconds would flood the log
        return


def serve(port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Start the endpoint on a daemon thread; returns the server (port 0 picks a free one)."""
    server = ThreadingHTTPServer((host, port), _Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
