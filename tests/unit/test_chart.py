"""The Helm chart, rendered and linted by the real helm binary (hack/build-control-plane.sh).

What the chart must keep true: the CRD is the generated one, byte for byte; the operator
runs non-root on a read-only root filesystem with probes on /healthz; RBAC is cluster-wide
by default and strictly namespaced when asked; values are schema-checked; metrics, alerts
and the dashboard are wired to each other.
"""

import argparse
import json
from typing import Any

import pytest
import yaml
from grpo_operator import instance_types
from grpo_operator.cli import build_parser
from kopf._cogs.structs import references

from tests.support.chart import CHART, HELM, NAMESPACE, ROOT, helm, render

pytestmark = pytest.mark.skipif(not HELM.exists(), reason="helm not built yet (make control-plane)")


def admission(doc: dict[str, Any]) -> bool:
    """The escalation policy's objects (tests/unit/test_escalation.py tests them)."""
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "admission"


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and not admission(d)]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def arg_value(args: list[str], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]


def test_chart_crd_is_the_generated_crd_byte_for_byte() -> None:
    assert (CHART / "crds" / "grpojobs.grpo.dev.yaml").read_bytes() == (
        ROOT / "crds" / "grpojobs.grpo.dev.yaml"
    ).read_bytes()


def test_peering_crds_are_the_ones_kopf_uses() -> None:
    crds = {
        d["spec"]["names"]["plural"]: d
        for d in yaml.safe_load_all((CHART / "crds" / "kopf-peerings.yaml").read_text())
    }
    for selector, scope in (
        (references.CLUSTER_PEERINGS_K, "Cluster"),
        (references.NAMESPACED_PEERINGS_K, "Namespaced"),
    ):
        crd = crds[selector.any_name]
        assert crd["spec"]["group"] == selector.group
        assert [v["name"] for v in crd["spec"]["versions"]] == [selector.version]
        assert crd["spec"]["scope"] == scope


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("watch.scope=namespaces", "watch.namespaces={ml,research}"),
        (
            "metrics.serviceMonitor.enabled=true",
            "metrics.prometheusRule.enabled=true",
            "metrics.podMonitor.enabled=true",
            "replicaCount=1",
        ),
        ("peering.enabled=false", "dashboard.enabled=false", "metrics.service.enabled=false"),
    ],
    ids=["defaults", "namespaced", "monitoring", "minimal"],
)
def test_helm_lint_strict_is_clean(sets: tuple[str, ...]) -> None:
    args = ["lint", str(CHART), "--strict", "--namespace", NAMESPACE]
    for s in sets:
        args += ["--set", s]
    proc = helm(*args)
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_operator_pod_is_hardened_and_probed() -> None:
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])
    assert {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")} == {"/tmp"}, (
        "only /tmp is writable"
    )
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert arg_value(c["args"], "--metrics-port") == [str(ports["metrics"])], "/healthz is served there"
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", "kopf peering identity"


def test_operator_args_parse_with_the_real_cli() -> None:
    """Every rendered flag exists in `grpo-operator operator` (argparse exits on unknown ones)."""
    for docs in (render("verbose=true"), render("watch.scope=namespaces", "watch.namespaces={a,b}")):
        args = container(docs)["args"]
        parsed = build_parser(args).parse_args(args)
        assert isinstance(parsed, argparse.Namespace) and parsed.command == "operator"


def cluster_resources(docs: list[dict[str, Any]]) -> set[str]:
    return {r for rule in one(docs, "ClusterRole")["rules"] for r in rule["resources"]}


def test_cluster_scope_rbac_and_peering() -> None:
    docs = render()
    assert "Role" not in kinds(docs) and "RoleBinding" not in kinds(docs)
    binding = one(docs, "ClusterRoleBinding")
    sa = one(docs, "ServiceAccount")["metadata"]
    assert binding["roleRef"]["name"] == one(docs, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": NAMESPACE}]
    assert {"grpojobs", "statefulsets", "pods", "nodes", "clusterkopfpeerings"} <= cluster_resources(docs)
    args = container(docs)["args"]
    assert args[0] == "operator" and not arg_value(args, "--namespace"), "no --namespace: every namespace"
    peering = one(docs, "ClusterKopfPeering")
    assert arg_value(args, "--peering") == [peering["metadata"]["name"]]


def test_namespace_scope_reads_only_nodes_namespaces_and_crds_cluster_wide() -> None:
    docs = render("watch.scope=namespaces", "watch.namespaces={ml,research}")
    assert "ClusterKopfPeering" not in kinds(docs)
    assert cluster_resources(docs) == {"nodes", "namespaces", "customresourcedefinitions"}
    roles = {d["metadata"]["namespace"] for d in docs if d["kind"] == "Role"}
    bindings = {d["metadata"]["namespace"] for d in docs if d["kind"] == "RoleBinding"}
    peerings = {d["metadata"]["namespace"] for d in docs if d["kind"] == "KopfPeering"}
    assert roles == bindings == peerings == {"ml", "research"}
    args = container(docs)["args"]
    assert arg_value(args, "--namespace") == ["ml", "research"]
    for role in (d for d in docs if d["kind"] == "Role"):
        resources = {r for rule in role["rules"] for r in rule["resources"]}
        assert {"grpojobs", "statefulsets", "kopfpeerings"} <= resources


def test_gang_scheduling_permissions_only_when_enabled() -> None:
    def groups(docs: list[dict[str, Any]]) -> set[str]:
        return {g for rule in one(docs, "ClusterRole")["rules"] for g in rule["apiGroups"]}

    assert not {"scheduling.x-k8s.io", "scheduling.volcano.sh"} & groups(render())
    docs = render("gangScheduling.schedulerPlugins=true", "gangScheduling.volcano=true")
    assert {"scheduling.x-k8s.io", "scheduling.volcano.sh"} <= groups(docs)


def test_kueue_permissions_and_flag_only_when_enabled() -> None:
    assert "kueue.x-k8s.io" not in str(render()) and "--kueue" not in container(render())["args"]
    docs = render("kueue.enabled=true", "watch.scope=namespaces", "watch.namespaces={ml}")
    args = container(docs)["args"]
    assert "--kueue" in args and build_parser(args).parse_args(args).kueue
    role = next(d for d in docs if d["kind"] == "Role")
    verbs = {r: set(rule["verbs"]) for rule in role["rules"] for r in rule["resources"]}
    assert verbs["workloads"] == {"get", "list", "watch", "create", "delete"}
    assert verbs["workloads/status"] == {"patch"}
    assert "resourceflavors" in cluster_resources(docs)  # cluster-scoped: in the ClusterRole


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("watch.scope=namespaces",), "minItems"),
        (("watch.scope=everywhere",), "scope"),
        (("replicaCount=0",), "replicaCount"),
        (("logFormat=chatty",), "logFormat"),
        (("metrics.port=70000",), "port"),
        (("no.such.key=1",), "no"),
    ],
)
def test_values_schema_rejects_bad_values(sets: tuple[str, ...], message: str) -> None:
    args = ["template", "grpo", str(CHART)]
    for s in sets:
        args += ["--set", s]
    proc = helm(*args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_rbac_has_no_wildcards_and_no_dangerous_verbs() -> None:
    for docs in (render(), render("watch.scope=namespaces", "watch.namespaces={ml}")):
        for role in (d for d in docs if d["kind"] in {"ClusterRole", "Role"}):
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
                if admission(role):  # the custom verb the admission policy checks, on grpojobs only
                    assert rule == {
                        "apiGroups": ["grpo.dev"],
                        "resources": ["grpojobs"],
                        "verbs": ["escalate"],
                    }
                    continue
                assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(rule["verbs"])
                if "customresourcedefinitions" in rule["resources"]:
                    assert set(rule["verbs"]) <= {"get", "list", "watch"}, "never create or change CRDs"
                assert "nodes" not in rule["resources"] or set(rule["verbs"]) <= {"list", "watch"}
                if "secrets" in rule["resources"]:
                    assert not {"list", "watch"} & set(rule["verbs"]), "never list every secret"


def test_operator_holds_every_right_it_grants_a_trainer_role() -> None:
    """RBAC forbids granting what one does not hold: each rendered trainer Role rule must be in the
    chart's rules, in both watch scopes."""
    from grpo_operator import render as render_job
    from grpo_operator.local.plan import load_job

    job = load_job(ROOT / "examples" / "p5-qwen3-30b-a3b.yaml")
    children = render_job.children(job, name="moe", namespace="ml", uid="uid-1")
    granted = {
        (g, r, v)
        for rule in next(c for c in children if c["kind"] == "Role")["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert ("discovery.k8s.io", "endpointslices", "list") in granted
    for docs in (render(), render("watch.scope=namespaces", "watch.namespaces={ml}")):
        held = {
            (g, r, v)
            for role in docs
            if role["kind"] in {"ClusterRole", "Role"} and not admission(role)
            for rule in role["rules"]
            for g in rule["apiGroups"]
            for r in rule["resources"]
            for v in rule["verbs"]
        }
        assert granted <= held, granted - held


def test_metrics_service_and_service_monitor_select_the_operator() -> None:
    docs = render("metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=kps")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]


def test_prometheus_rule_alerts_and_thresholds() -> None:
    docs = render(
        "metrics.prometheusRule.enabled=true",
        "metrics.prometheusRule.noProgressMinutes=45",
        "metrics.prometheusRule.restartingMinutes=7",
    )
    rules = {r["alert"]: r for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]}
    assert {"GRPOJobFailed", "GRPOJobGangRestarting", "GRPOJobNoProgress"} <= set(rules)
    assert "[45m]" in rules["GRPOJobNoProgress"]["expr"]
    assert rules["GRPOJobGangRestarting"]["for"] == "7m"
    for rule in rules.values():
        assert (
            "{{ $labels" in rule["annotations"]["summary"]
            or "grpo-operator" in rule["annotations"]["summary"]
        )
    assert "PrometheusRule" not in kinds(render()), (
        "optional: off by default (needs prometheus-operator CRDs)"
    )


def test_dashboard_configmap_carries_the_dashboard() -> None:
    docs = render("dashboard.namespace=monitoring")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["grpo-operator.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "grpo-operator.json").read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in (
        "phase",
        "step",
        "reward",
        "tokens per second",
        "restarts",
        "rollout vs train",
        "all-to-all",
    ):
        assert topic in titles, topic
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_pdb_only_with_several_replicas() -> None:
    assert "PodDisruptionBudget" in kinds(render())
    assert "PodDisruptionBudget" not in kinds(render("replicaCount=1"))


def test_instance_types_reach_the_operator_as_a_file_it_loads() -> None:
    docs = render("instanceTypes.p6e-gb200\\.36xlarge.gpus=4", "instanceTypes.p6e-gb200\\.36xlarge.efa=8")
    cm = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-instance-types")
    )
    c = container(docs)
    (path,) = arg_value(c["args"], "--instance-types")
    mount = next(m for m in c["volumeMounts"] if m["name"] == "instance-types")
    assert path == f"{mount['mountPath']}/instance-types.yaml"
    table = instance_types.BUILTIN.merged(yaml.safe_load(cm["data"]["instance-types.yaml"]))
    assert (table.get("p6e-gb200.36xlarge").gpus, table.get("p6e-gb200.36xlarge").efa) == (4, 8)
    assert not arg_value(container(render())["args"], "--instance-types"), "off by default"


def test_job_scrapers_reach_the_operator_as_network_policy_peers() -> None:
    assert not [a for a in container(render())["args"] if a.startswith("--metrics-from")]
    label = "kubernetes\\.io/metadata\\.name"
    peer = f"metrics.jobScrapersFrom[0].namespaceSelector.matchLabels.{label}=monitoring"
    args = container(render(peer))["args"]
    parsed = build_parser(args).parse_args(args).metrics_from
    assert parsed == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
