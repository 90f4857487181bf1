"""Prometheus `/metrics` of trainer rank 0: the newest step report, as gauges.

Fed by `progress.ProgressReporter` with every `StepReport`; served on the contract's
`trainer.metricsPort` (the trainer pod's `metrics` port, scraped by the chart's PodMonitor).
The series derive from the report model itself, so a field added to `StepReport` is exported
without touching this file: every numeric field `x` becomes `grpo_trainer_x` (`_s` spelled
`_seconds`, `_per_s` spelled `_per_second`, its description the HELP text), and every entry of
`report.metrics` (loss, kl, entropy, clip_frac, grad_norm...) becomes
`grpo_trainer_metric{name="..."}`; the newest held-out evaluation's fields (`report.evals`)
become `grpo_trainer_eval_x` and stay until the next one. A field that is None in the newest
report (no EP, say) has no series rather than a made-up zero; nothing is exported before the
first step.
"""

import math
import threading
import types
import typing
from collections.abc import Iterator

from grpo_operator.api.report import EvalScore, StepReport
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel

PREFIX = "grpo_trainer_"
METRIC_FAMILY = f"{PREFIX}metric"
EVAL_PREFIX = "eval_"
RENAMED = {"time": "report_time_seconds"}  # Unix time of the newest report: staleness alerts read it


def series_name(field: str) -> str:
    """The Prometheus name of a StepReport field (base units spelled out, as Prometheus asks)."""
    if field in RENAMED:
        return PREFIX + RENAMED[field]
    if field.endswith("_per_s"):
        return f"{PREFIX}{field[: -len('_per_s')]}_per_second"
    if field.endswith("_s"):
        return f"{PREFIX}{field[: -len('_s')]}_seconds"
    return PREFIX + field


def _numeric(annotation: object) -> bool:
    """int / float, optional or not (bool excluded: it is an int to Python, not a measurement)."""
    if annotation in (int, float):
        return True
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return all(a in (int, float, type(None)) for a in typing.get_args(annotation))
    return False


def _numeric_fields(model: type[BaseModel]) -> tuple[str, ...]:
    return tuple(f for f, info in model.model_fields.items() if _numeric(info.annotation))


NUMERIC_FIELDS = _numeric_fields(StepReport)
EVAL_FIELDS = _numeric_fields(EvalScore)


def _values(obj: BaseModel, fields: tuple[str, ...], prefix: str = "") -> dict[str, float]:
    values = {prefix + f: getattr(obj, f) for f in fields}
    return {f: float(v) for f, v in values.items() if v is not None and math.isfinite(v)}


def report_values(report: StepReport) -> dict[str, float]:
    """The report's numeric fields that have a value (None and NaN left out), by field name."""
    return _values(report, NUMERIC_FIELDS)


def eval_values(score: EvalScore) -> dict[str, float]:
    """One held-out evaluation's numbers as eval_reward, eval_pass_at_k, eval_step..."""
    return _values(score, EVAL_FIELDS, prefix=EVAL_PREFIX)


def _help(field: str) -> str:
    if field.startswith(EVAL_PREFIX) and field[len(EVAL_PREFIX) :] in EVAL_FIELDS:
        info = EvalScore.model_fields[field[len(EVAL_PREFIX) :]]
        return f"Newest held-out evaluation: {info.description or field}"
    return StepReport.model_fields[field].description or field


def step_metrics(report: StepReport) -> dict[str, float]:
    """`report.metrics` entries that have a value (loss, kl, entropy, clip_frac, grad_norm...)."""
    return {k: float(v) for k, v in report.metrics.items() if v is not None and math.isfinite(v)}


class ReportCollector(Collector):
    """Holds the newest report; each scrape turns it into gauge families."""

    def __init__(self) -> None:
        self._latest: StepReport | None = None
        self._eval: EvalScore | None = None  # kept: most reports carry no evaluation
        self._lock = threading.Lock()

    def observe(self, report: StepReport) -> None:
        with self._lock:
            self._latest = report
            self._eval = report.evals[-1] if report.evals else self._eval

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            report, score = self._latest, self._eval
        if report is None:
            return
        values = {**report_values(report), **(eval_values(score) if score else {})}
        for field, value in values.items():
            yield GaugeMetricFamily(series_name(field), _help(field), value=value)
        family = GaugeMetricFamily(
            METRIC_FAMILY, "Loss terms and diagnostics of the newest step, by name.", labels=["name"]
        )
        for name, value in sorted(step_metrics(report).items()):
            family.add_metric([name], value)
        yield family


class MetricsExporter:
    """An HTTP server answering GET /metrics from its own registry (not the process-global one,
    so tests can run several), on a daemon thread: a scrape never waits on a training step."""

    def __init__(self, port: int, addr: str = "0.0.0.0") -> None:
        self.collector = ReportCollector()
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)

    @property
    def port(self) -> int:
        """The bound port (the one asked for, or the kernel's pick when asked for 0)."""
        return self._server.server_port

    def report(self, report: StepReport) -> None:
        self.collector.observe(report)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
