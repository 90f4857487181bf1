"""The GRPOJob CRD on a real API server, and offline validation held to the server's verdicts.

Installs the CRD exactly as a user does (`grpo-operator crd | kubectl apply --server-side -f -`),
then checks `kubectl explain`, the printer columns, server-side defaulting, the scale
subresource, and that the invalid corpus (tests/fixtures/invalid), the forbidden updates
(tests/fixtures/updates) and the examples get the same verdict from the API server as from
`grpo_operator.validation`, each rejection naming the field of the fixture's `# expect:` line
and the server naming every field that offline validation names; so do the shipped examples
broken one field at a time (tests/support/example_mutations.py), `template.spec` included.
"""

import copy
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from grpo_operator import crd, validation
from grpo_operator.api.job import GROUP, PLURAL, VERSION
from kubernetes import client

from tests.support import example_mutations

ROOT = Path(__file__).resolve().parents[2]
INVALID = sorted((ROOT / "tests" / "fixtures" / "invalid").glob("*.yaml"))
UPDATES = sorted((ROOT / "tests" / "fixtures" / "updates").glob("*.new.yaml"))
# GRPOJob examples only: the EKS infrastructure files are checked by tests/unit/test_examples.py.
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.yaml") if "kind: GRPOJob" in p.read_text())
CRD_NAME = "grpojobs.grpo.dev"
IMMUTABLE_TRAINER = ("replicas", "processesPerPod", "expertParallelSize")


def expected(path: Path) -> str:
    return path.read_text().splitlines()[0].removeprefix("# expect: ").strip()


def in_namespace(path: Path, namespace: str) -> str:
    """The file's GRPOJobs as JSON, moved to the test's namespace (examples may name their own)."""
    items = []
    for doc in yaml.safe_load_all(path.read_text()):
        if validation.is_grpojob(doc):
            doc.setdefault("metadata", {})["namespace"] = namespace
            items.append(doc)
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


@pytest.fixture(scope="module")
def crd_installed(kubectl: Any, wait_for: Any) -> None:
    """Install the CRD the documented way and wait until the API server serves it."""
    text = subprocess.run(
        [sys.executable, "-m", "grpo_operator.cli", "crd"], capture_output=True, text=True, check=True
    ).stdout
    out = kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text)
    assert f"customresourcedefinition.apiextensions.k8s.io/{CRD_NAME} serverside-applied" in out.stdout
    assert "Warning" not in out.stderr, out.stderr
    # polled, not `kubectl wait`: that fails at once while a new CRD has no status.conditions yet
    established = 'jsonpath={.status.conditions[?(@.type=="Established")].status}'
    wait_for(
        lambda: kubectl("get", "crd", CRD_NAME, "-o", established, check=False).stdout == "True",
        what=f"crd/{CRD_NAME} Established",
        timeout=60,
    )


def test_crd_is_accepted_with_names_and_no_cel_cost_complaints(crd_installed: None, kubectl: Any) -> None:
    crd = json.loads(kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["grpo"]
    assert "ml" in crd["status"]["acceptedNames"]["categories"]


def test_explain_shows_field_descriptions(crd_installed: None, kubectl: Any, wait_for: Any) -> None:
    def explained() -> str:
        proc = kubectl("explain", "grpojob.spec.algorithm", check=False)
        return proc.stdout if proc.returncode == 0 and "groupSize" in proc.stdout else ""

    text = wait_for(explained, what="kubectl explain grpojob.spec.algorithm", timeout=60)
    assert "Completions per prompt" in text
    assert "GSPO" in text or "gspo" in text
    spec = kubectl("explain", "grpojob.spec").stdout
    assert "What to train, on what, and how" in spec and "trainer" in spec


def test_get_shows_printer_columns_defaults_and_scale(
    crd_installed: None, kubectl: Any, namespace: str
) -> None:
    kubectl("create", "-f", "-", input=in_namespace(ROOT / "examples" / "minimal.yaml", namespace))
    stored = json.loads(kubectl("get", "grpo", "minimal", "-n", namespace, "-o", "json").stdout)
    assert stored["spec"]["trainer"]["replicas"] == 1  # defaulted by the API server, not the operator
    assert stored["spec"]["algorithm"]["groupSize"] == 8
    assert stored["spec"]["network"]["efa"] == "auto"

    status = {
        "phase": "Running",
        "restarts": 1,
        "trainer": {"replicas": 1, "ready": 1, "readyText": "1/1"},
        "rollout": {"replicas": 1, "ready": 0, "readyText": "0/1"},
        "progress": {"step": 12, "rewardMean": 0.75, "tokensPerSecond": 4321.5, "evalReward": 0.6},
    }
    patch = json.dumps({"status": status})
    kubectl("patch", "grpo", "minimal", "-n", namespace, "--subresource=status", "--type=merge", "-p", patch)
    lines = kubectl("get", "grpo", "-n", namespace).stdout.splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "STEP", "REWARD", "TRAINERS", "ROLLOUTS", "AGE"]
    assert lines[1].split()[:6] == ["minimal", "Running", "12", "0.75", "1/1", "0/1"]
    wide = kubectl("get", "grpo", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-5:] == ["RESTARTS", "TOKENS/S", "EVAL", "MODEL", "REWARDMODELS"]
    # the last column is blank without spec.reward.model
    assert wide[1].split()[-4:] == ["1", "4321.5", "0.6", "s3://my-models/Qwen3-30B-A3B"]
    assert "minimal" in kubectl("get", "ml", "-n", namespace).stdout  # the category

    kubectl("scale", "grpo/minimal", "-n", namespace, "--replicas=3")
    scaled = json.loads(kubectl("get", "grpo", "minimal", "-n", namespace, "-o", "json").stdout)
    assert scaled["spec"]["rollout"]["replicas"] == 3


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_manifest_rejected_by_server_and_offline(
    crd_installed: None, kubectl: Any, namespace: str, path: Path
) -> None:
    fragment = expected(path)
    proc = kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-", input=path.read_text(), check=False
    )
    assert proc.returncode != 0, f"the API server accepted {path.name}"
    assert fragment in proc.stderr, f"server message does not name {fragment!r}: {proc.stderr}"
    offline = validation.validate_file(path)
    assert any(fragment in str(p) for p in offline), f"offline verdict differs: {[str(p) for p in offline]}"
    for problem in offline:  # and the server names every field offline validation names
        assert problem.path == "<root>" or problem.path in proc.stderr, f"{problem} not in {proc.stderr}"


@pytest.mark.parametrize("new", UPDATES, ids=lambda p: p.name.removesuffix(".new.yaml"))
def test_forbidden_update_rejected_by_server_and_offline(
    crd_installed: None, kubectl: Any, namespace: str, new: Path
) -> None:
    old = new.with_name(new.name.replace(".new.", ".old."))
    kubectl("create", "-n", namespace, "-f", "-", input=old.read_text())
    apply = ("apply", "--server-side", "--force-conflicts", "-n", namespace, "-f", "-")
    proc = kubectl(*apply, input=new.read_text(), check=False)
    assert proc.returncode != 0, f"the API server accepted the update {new.name}"
    assert expected(new) in proc.stderr and "immutable" in proc.stderr, proc.stderr
    assert [p.path for p in validation.validate_file(new, old=old)] == [expected(new)]
    # the same job may still change what is mutable: rollout replicas and their bounds
    rollout = "    instanceType: p5.48xlarge\n    replicas: 2\n"  # the rollout section ends each fixture
    assert "\n  rollout:\n" in old.read_text() and old.read_text().endswith(rollout)
    allowed = old.read_text().removesuffix(rollout) + f"{rollout[:-2]}3\n    maxReplicas: 4\n"
    kubectl(*apply, input=allowed)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_example_accepted_by_server_and_offline(
    crd_installed: None, kubectl: Any, namespace: str, path: Path
) -> None:
    body = in_namespace(path, namespace)
    assert json.loads(body)["items"], f"{path.name} holds no GRPOJob"
    kubectl("create", "--dry-run=server", "-f", "-", input=body)
    assert validation.validate_file(path) == []


def test_an_environment_job_may_leave_reward_out_on_the_server_as_offline(
    crd_installed: None, kubectl: Any, namespace: str, tmp_path: Path
) -> None:
    """Issue 46: the fixture refused for scoring nothing is accepted once an environment scores."""
    refused = ROOT / "tests" / "fixtures" / "invalid" / "rule-no-reward-no-environment.yaml"
    path = tmp_path / "environment-only.yaml"
    extra = "  environment:\n    class: my_pkg.games:Guess\n  checkpoint:\n    path: s3://ckpt/env\n"
    path.write_text(refused.read_text() + extra)  # (a gang of 2 checkpoints to s3: the fixture has none)
    kubectl("create", "--dry-run=server", "-f", "-", input=in_namespace(path, namespace))
    assert validation.validate_file(path) == []


class Mutator:
    """Sets random spec fields to boundary, wrong-typed, enum or null values (seeded, repeatable)."""

    SCALARS = (None, True, "", "x", "1e-6", "s3://b/k", "http://x", 0, -1, 1, 2, 3, 7, 2.5, 1.0)

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.leaves: list[tuple[tuple[str, ...], dict[str, Any]]] = []
        self._walk(crd.openapi_schema()["properties"]["spec"], ("spec",))

    def _walk(self, node: dict[str, Any], path: tuple[str, ...]) -> None:
        self.leaves.append((path, node))
        for name, sub in node.get("properties", {}).items():
            self._walk(sub, (*path, name))

    def _plausible(self, node: dict[str, Any]) -> list[Any]:
        """Values of the right type within bounds: the schema accepts them, CEL rules may not."""
        if "enum" in node or node.get("type") == "boolean":
            return list(node.get("enum", [True, False]))
        if node.get("type") in ("integer", "number"):
            low = node.get("minimum", 0) + (1 if node.get("exclusiveMinimum") else 0)
            return [low, min(low + 1, node.get("maximum", low + 1)), node.get("maximum", low + 7)]
        return []

    def mutate(self, doc: dict[str, Any], changes: int, plausible: bool = False) -> dict[str, Any]:
        doc = copy.deepcopy(doc)
        for _ in range(changes):
            path, node = self.rng.choice(self.leaves)
            pool: list[Any] = [*self.SCALARS, [], {}, {"a": 1}, ["a"], *node.get("enum", [])]
            for key in ("minimum", "maximum", "minItems", "maxItems"):
                pool += [node[key] - 1, node[key], node[key] + 1] if key in node else []
            pool += ["a" * node["maxLength"], "a" * (node["maxLength"] + 1)] if "maxLength" in node else []
            while plausible and not (pool := self._plausible(node)):
                path, node = self.rng.choice(self.leaves)
            parent = doc
            for part in path[:-1]:
                parent = parent.setdefault(part, {}) if isinstance(parent.get(part, {}), dict) else {}
            parent[path[-1]] = copy.deepcopy(self.rng.choice(pool))
        return doc


def random_manifests(seed: int, count: int) -> list[dict[str, Any]]:
    """Valid jobs with one or two spec fields set to random values; names fuzz-0, fuzz-1, ..."""
    base = yaml.safe_load((ROOT / "tests" / "fixtures" / "updates" / "trainer-replicas.old.yaml").read_text())
    base["spec"]["rollout"]["tolerations"] = [{"key": "spot", "operator": "Exists"}]
    mutator = Mutator(seed)
    docs = []
    for i in range(count):
        base["metadata"]["name"] = f"fuzz-{i}"
        docs.append(mutator.mutate(base, mutator.rng.choice((1, 1, 2))))
    return docs


def compare(accepted: set[str], verdicts: dict[str, list[Any]], stderr: str) -> None:
    """Fail naming every job whose offline verdict differs from the server's."""
    offline = {name for name, problems in verdicts.items() if not problems}
    differ = sorted(accepted ^ offline, key=lambda n: int(n.split("-")[1]))
    details = [
        f"{n}: offline {verdicts[n]}; server {'accepted' if n in accepted else 'rejected'}" for n in differ
    ]
    assert not differ, "\n".join(details) + "\n" + stderr[-3000:]
    assert 5 < len(accepted) < len(verdicts) - 5, "the cases must exercise both verdicts"


def test_random_manifests_get_the_same_verdict_offline_and_on_the_server(
    crd_installed: None, kubectl: Any, namespace: str
) -> None:
    """Differential check beyond the corpus: YAML through kubectl against YAML through `validate`."""
    docs = random_manifests(seed=20261202, count=200)
    text = yaml.safe_dump_all(docs, sort_keys=False)
    proc = kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-", input=text, check=False, timeout=300
    )
    accepted = set(re.findall(r"^grpojob\.grpo\.dev/(\S+) created", proc.stdout, re.MULTILINE))
    loaded, errors = validation.load_documents(text, "random.yaml")
    assert errors == [] and len(loaded) == len(docs)
    compare(
        accepted, {d.data["metadata"]["name"]: validation.check_object(d.data) for d in loaded}, proc.stderr
    )


def test_random_updates_get_the_same_verdict_offline_and_on_the_server(
    crd_installed: None, kubectl: Any, namespace: str
) -> None:
    """Updates of stored jobs (defaults filled in by the server), immutable fields included."""
    random_olds = yaml.safe_dump_all(random_manifests(seed=7, count=400))
    as_kubectl_reads = [d.data for d in validation.load_documents(random_olds, "olds.yaml")[0]]
    olds = [d for d in as_kubectl_reads if not validation.check_object(d)][:60]
    kubectl("create", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(olds), timeout=300)
    stored = json.loads(kubectl("get", "grpo", "-n", namespace, "-o", "json").stdout)["items"]
    mutator = Mutator(seed=8)
    news = [
        mutator.mutate({k: v for k, v in s.items() if k != "status"}, 1, plausible=i % 2 == 0)
        for i, s in enumerate(stored)
    ]
    for new in news[::4]:  # and some changes aimed at the immutable fields
        role, name = mutator.rng.choice([("model", "path"), *(("trainer", f) for f in IMMUTABLE_TRAINER)])
        new["spec"][role][name] = "s3://models/other" if role == "model" else new["spec"][role][name] * 2
    text = yaml.safe_dump_all(news, sort_keys=False)
    proc = kubectl("replace", "--dry-run=server", "-f", "-", input=text, check=False, timeout=300)
    accepted = set(re.findall(r"^grpojob\.grpo\.dev/(\S+) replaced", proc.stdout, re.MULTILINE))
    loaded, errors = validation.load_documents(text, "updates.yaml")
    assert errors == [] and len(loaded) == len(news)
    by_name = {s["metadata"]["name"]: s for s in stored}
    verdicts = {
        d.data["metadata"]["name"]: validation.check_object(d.data, by_name[d.data["metadata"]["name"]])
        for d in loaded
    }
    compare(accepted, verdicts, proc.stderr)


def test_each_example_field_broken_alone_is_refused_by_the_server_as_offline(
    crd_installed: None, k8s_api: Any, namespace: str
) -> None:
    """tests/support/example_mutations.py on the API server: every one refused, naming the broken field.

    Sent one by one as server-side dry-run creates with strict field validation (what kubectl
    does by default), so each refusal is matched to its mutation; `validate` must name the same
    field, and the server every field `validate` names.
    """
    api = client.CustomObjectsApi(k8s_api)
    wrong = []
    for case in example_mutations.mutations():
        body = {**case.doc, "metadata": {"name": case.name, "namespace": namespace}}
        try:
            api.create_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, body, dry_run="All", field_validation="Strict"
            )
            wrong.append(f"{case.example}: {case.change} at {case.field}: accepted by the server")
            continue
        except client.ApiException as err:
            message = json.loads(err.body).get("message", err.body) if err.body else str(err)
        offline = [validation.dotted(p) for p, _ in validation.check_object(case.doc)]
        if case.field not in message or case.field not in offline:
            wrong.append(f"{case.example}: {case.change}: server {message!r}, offline {offline}")
        elif unnamed := [p for p in offline if p not in message]:
            wrong.append(f"{case.example}: {case.change}: server does not name {unnamed}: {message!r}")
    assert not wrong, f"{len(wrong)} differ:\n" + "\n".join(wrong[:40])


def test_partial_template_overrides_are_accepted_by_the_server(
    crd_installed: None, kubectl: Any, namespace: str
) -> None:
    base = yaml.safe_load(in_namespace(ROOT / "examples" / "minimal.yaml", namespace))["items"][0]
    items = []
    for i, override in enumerate(example_mutations.VALID_TEMPLATES):
        for role in ("trainer", "rollout"):
            job = copy.deepcopy(base)
            job["metadata"]["name"] = f"partial-{role}-{i}"
            job["spec"].setdefault(role, {})["template"] = {
                "spec": example_mutations.with_main(override, role)
            }
            assert validation.check_object(job) == [], override
            items.append(job)
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
    kubectl("create", "--dry-run=server", "-f", "-", input=body)
