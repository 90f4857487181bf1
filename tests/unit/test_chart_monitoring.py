"""Monitoring wiring: every series the dashboard and the alerts query has a producer.

Producers are the prometheus_client metrics defined in our code (operator, rollout, trainer)
and the kube-state-metrics Custom Resource State config shipped with the chart, whose paths
must exist in the GRPOJob status model, so a renamed status field breaks this test rather
than a dashboard in production.
"""

import ast
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from grpo_operator.api.status import GRPOJobStatus, Phase

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
    produced = code_metrics() | ksm_metrics()
    assert "grpo_operator_gang_restarts_total" in produced, "the operator's metrics were found"
    missing = queried() - produced
    assert not missing, f"the dashboard or alerts query series nobody exports: {sorted(missing)}"


def test_dashboard_and_alerts_use_the_job_labels() -> None:
    """Per-job series are labelled namespace/grpojob (never `job`, which Prometheus owns)."""
    assert all(m["each"]["type"] in {"Gauge", "StateSet"} for m in RESOURCE["metrics"])
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p["targets"]]
    assert not [e for e in exprs if re.search(r"\bjob=", e)]
    assert all("grpojob" in e for e in exprs if "grpo_job_" in e and "phase" not in e)
