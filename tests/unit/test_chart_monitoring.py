"""Monitoring wiring: every series the dashboard and the alerts query has a producer.

Producers are the prometheus_client metrics defined in our code (operator, rollout), the series
trainer rank 0's exporter serves for a report with every field set (their names derive from the
StepReport model), and the kube-state-metrics Custom Resource State config shipped with the
chart, whose paths must be written: by the operator's lifecycle for a running job, or by rank 0's
report as status.progress. So a panel over a field nothing fills in, or a renamed field, breaks
this test rather than a dashboard in production.
"""

import ast
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from grpo_operator import render
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.report import EvalScore, StepReport
from grpo_operator.api.status import GRPOJobStatus, Phase
from grpo_operator.render import names
from grpo_trainer import exporter

from tests.support.chart import render as chart
from tests.support.status import all_ready, decide

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "grpo-operator"
KSM = yaml.safe_load((CHART / "monitoring" / "kube-state-metrics-values.yaml").read_text())[
    "kube-state-metrics"
]
RESOURCE = KSM["customResourceState"]["config"]["spec"]["resources"][0]
DASHBOARD = json.loads((CHART / "dashboards" / "grpo-operator.json").read_text())
SERIES_SUFFIXES = {"Counter": ("_total", "_created"), "Histogram": ("_bucket", "_sum", "_count", "_created")}


def code_metrics() -> set[str]:
    """Series names of every prometheus_client Counter/Gauge/Histogram/Summary in our packages."""
    names: set[str] = set()
    for package in ("operator", "rollout", "trainers"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                    continue
                kind = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if kind in {"Counter", "Gauge", "Histogram", "Summary"} and isinstance(
                    node.args[0].value, str
                ):
                    base = node.args[0].value
                    names.add(base)
                    names.update(base + s for s in SERIES_SUFFIXES.get(kind, ()))
    return names


def trainer_metric_names() -> set[str]:
    """Names the trainer puts in StepReport.metrics: keys of the dicts loss, step, loop and batch build."""
    found: set[str] = set()
    for module in ("losses.py", "loop.py", "step.py", "batch.py"):
        for node in ast.walk(ast.parse((ROOT / "trainers" / "grpo_trainer" / module).read_text())):
            keys = node.keys if isinstance(node, ast.Dict) else []
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                keys = [node.slice]
            found.update(k.value for k in keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return found


def full_report() -> StepReport:
    """A step report with every numeric field set, the trainer's metrics, and one evaluation."""
    score = EvalScore.model_validate({f: 1 for f in exporter.EVAL_FIELDS})
    numeric = {f: 1 for f in exporter.NUMERIC_FIELDS}
    return StepReport.model_validate(
        {**numeric, "metrics": dict.fromkeys(trainer_metric_names(), 1.0), "evals": [score]}
    )


def trainer_series() -> set[str]:
    """What trainer rank 0's exporter serves once a report with every field has arrived."""
    collector = exporter.ReportCollector()
    collector.observe(full_report())
    return {family.name for family in collector.collect()}


def written_status() -> dict[str, Any]:
    """A GRPOJob's status as its writers leave it: the operator's lifecycle for a running job, and
    rank 0's report as status.progress (`StepReport.to_progress`, the only writer of progress)."""
    status = decide(all_ready()).status.model_dump(by_alias=True, exclude_none=True, mode="json")
    return {**status, "progress": full_report().to_progress().wire()}


def ksm_metrics() -> set[str]:
    return {f"{RESOURCE['metricNamePrefix']}_{m['name']}" for m in RESOURCE["metrics"]}


def queried() -> set[str]:
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]
    exprs += [
        v["query"]["query"] for v in DASHBOARD["templating"]["list"] if isinstance(v.get("query"), dict)
    ]
    rule = subprocess.run(
        [
            "bash",
            "-c",
            f'"$(bash {ROOT}/hack/build-control-plane.sh print-bin-dir)/helm" template g {CHART} '
            "--set metrics.prometheusRule.enabled=true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for doc in yaml.safe_load_all(rule):
        if doc and doc["kind"] == "PrometheusRule":
            exprs += [r["expr"] for g in doc["spec"]["groups"] for r in g["rules"]]
    return {m for e in exprs for m in re.findall(r"\bgrpo_[a-z0-9_]+\b", e)}


def status_path_exists(path: list[str]) -> bool:
    schema = GRPOJobStatus.model_json_schema(by_alias=True)
    node: dict[str, Any] = schema
    for key in path:
        node = node.get("properties", {}).get(key)
        if node is None:
            return False
        ref = node.get("$ref") or next((a["$ref"] for a in node.get("anyOf", []) if "$ref" in a), None)
        if ref:
            node = schema["$defs"][ref.rsplit("/", 1)[-1]]
    return True


def metric_path(metric: dict[str, Any]) -> list[str]:
    each = metric["each"]
    return each["gauge"]["path"] if each["type"] == "Gauge" else each["stateSet"]["path"]


@pytest.mark.parametrize("metric", RESOURCE["metrics"], ids=lambda m: m["name"])
def test_kube_state_metrics_paths_exist_in_the_status_model(metric: dict[str, Any]) -> None:
    path = metric_path(metric)
    assert path[0] == "status" and status_path_exists(path[1:]), path


@pytest.mark.parametrize("metric", RESOURCE["metrics"], ids=lambda m: m["name"])
def test_kube_state_metrics_paths_are_written(metric: dict[str, Any]) -> None:
    node: Any = {"status": written_status()}
    for key in metric_path(metric):
        assert isinstance(node, dict) and node.get(key) is not None, f"nothing writes {metric_path(metric)}"
        node = node[key]


def test_kube_state_metrics_config_shape() -> None:
    assert RESOURCE["groupVersionKind"] == {"group": "grpo.dev", "version": "v1alpha1", "kind": "GRPOJob"}
    assert RESOURCE["labelsFromPath"] == {
        "namespace": ["metadata", "namespace"],
        "grpojob": ["metadata", "name"],
    }
    (phase,) = [m for m in RESOURCE["metrics"] if m["each"]["type"] == "StateSet"]
    assert phase["each"]["stateSet"]["list"] == [p.value for p in Phase]
    rule = next(r for r in KSM["rbac"]["extraRules"] if "grpojobs" in r["resources"])
    assert rule["verbs"] == ["list", "watch"] and rule["apiGroups"] == ["grpo.dev"]


def test_every_queried_series_has_a_producer() -> None:
    produced = code_metrics() | ksm_metrics() | trainer_series()
    assert "grpo_operator_gang_restarts_total" in produced, "the operator's metrics were found"
    assert {"grpo_trainer_rollout_seconds", "grpo_trainer_eval_reward"} <= produced
    missing = queried() - produced
    assert not missing, f"the dashboard or alerts query series nobody exports: {sorted(missing)}"


def test_every_trainer_metric_name_the_dashboard_asks_for_is_emitted() -> None:
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]
    asked = {
        name
        for e in exprs
        for m in re.finditer(rf'{exporter.METRIC_FAMILY}{{name=~?"([^"]+)"', e)
        for name in m.group(1).split("|")
    }
    assert {"kl", "entropy", "clip_frac", "grad_norm"} <= asked
    assert asked <= trainer_metric_names(), asked - trainer_metric_names()


def test_dashboard_and_alerts_use_the_job_labels() -> None:
    """Per-job series are labelled namespace/grpojob (never `job`, which Prometheus owns)."""
    assert all(m["each"]["type"] in {"Gauge", "StateSet"} for m in RESOURCE["metrics"])
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]
    assert not [e for e in exprs if re.search(r"\bjob=", e)]
    assert all("grpojob" in e for e in exprs if "grpo_job_" in e and "phase" not in e)


def prometheus_label(label: str) -> str:
    """How Prometheus' Kubernetes discovery names a pod label: __meta_kubernetes_pod_label_<sanitised>."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def test_pod_monitor_scrapes_trainer_rank_0_and_every_rollout_and_reward_server_as_rendered() -> None:
    assert not [d for d in chart() if d["kind"] == "PodMonitor"], "opt-in: needs prometheus-operator's CRDs"
    (monitor,) = [d for d in chart("metrics.podMonitor.enabled=true") if d["kind"] == "PodMonitor"]
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True}
    job = GRPOJob.model_validate(
        {
            "spec": {
                "model": {"path": "/m"},
                "dataset": {"path": "/d"},
                "reward": {"functions": [{"builtin": "math"}], "model": {"path": "/rm"}},
            }
        }
    )
    rendered = render.render(job, name="j", namespace="ml", uid="u")
    http = {names.ROLE_ROLLOUT: names.ROLLOUT_PORT, names.ROLE_REWARD: names.REWARD_PORT}
    endpoints = {e["port"]: e for e in spec["podMetricsEndpoints"]}
    for sts in (c for c in rendered.children if c["kind"] == "StatefulSet"):
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        (expr,) = spec["selector"]["matchExpressions"]
        assert expr["key"] == names.LABEL_ROLE and labels[names.LABEL_ROLE] in expr["values"]
        ports = {
            p["name"]: p["containerPort"] for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]
        }
        (scraped,) = set(ports) & set(endpoints)  # each role's pods expose exactly one scraped port
        assert ports[scraped] == (
            names.TRAINER_METRICS_PORT
            if labels[names.LABEL_ROLE] == names.ROLE_TRAINER
            else http[labels[names.LABEL_ROLE]]
        )
    keep = endpoints["metrics"]["relabelings"][0]
    assert keep == {"sourceLabels": [prometheus_label(names.LABEL_POD_INDEX)], "regex": "0", "action": "keep"}
    for endpoint in endpoints.values():
        assert endpoint["path"] == "/metrics"
        job_label = {"sourceLabels": [prometheus_label(names.LABEL_JOB)], "targetLabel": "grpojob"}
        assert job_label in endpoint["relabelings"], "series carry the job as kube-state-metrics does"


def test_pod_monitor_follows_the_watched_namespaces() -> None:
    docs = chart(
        "metrics.podMonitor.enabled=true", "watch.scope=namespaces", "watch.namespaces={ml,research}"
    )
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml", "research"]}
