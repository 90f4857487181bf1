"""Unit tests of `grpo-operator render`: manifests on stdout, conflicts and errors on stderr."""

import yaml
from grpo_operator.cli import main

JOB = """
apiVersion: grpo.dev/v1alpha1
kind: GRPOJob
metadata: {name: moe}
spec:
  model: {path: s3://models/m}
  dataset: {path: s3://data/d.jsonl}
  reward: {functions: [{builtin: math}]}
  trainer: {replicas: 2, instanceType: %s,
    template: {spec: {containers: [{name: trainer, image: other}]}}}
"""


def test_render_prints_children_and_reports_conflicts(tmp_path, capsys):
    f = tmp_path / "job.yaml"
    f.write_text(JOB % "p5.48xlarge")
    assert main(["render", str(f), "-n", "team"]) == 0
    out, err = capsys.readouterr()
    docs = list(yaml.safe_load_all(out))
    assert len(docs) == 12 and {d["metadata"]["namespace"] for d in docs} == {"team"}
    assert "warning: team/moe: trainer.template.spec.containers[trainer].image" in err


def test_render_contract_only(tmp_path, capsys):
    f = tmp_path / "job.yaml"
    f.write_text(JOB % "p5.48xlarge")
    assert main(["render", str(f), "--contract", "-o", "json"]) == 0
    contract = yaml.safe_load(capsys.readouterr().out)
    assert contract["trainer"]["masterAddr"] == "moe-trainer-0.moe-trainer.default.svc"


def test_render_unknown_instance_type_exits_1_with_the_reason(tmp_path, capsys):
    f = tmp_path / "job.yaml"
    f.write_text(JOB % "p9.bogus")
    assert main(["render", str(f)]) == 1
    assert "unknown instance type 'p9.bogus'" in capsys.readouterr().err
