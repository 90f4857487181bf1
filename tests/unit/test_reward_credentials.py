"""spec.reward.credentialsSecret (a hosted judge's API key): the Secret mounted read-only as files in
the rollout pods only, found by rewards through $GRPO_REWARD_FILES (`grpo_rollout.rewards.credentials`),
a folder of the user's in `grpo-operator run`; errors name the field and the keys there are."""

from pathlib import Path

import pytest
from grpo_operator.local.plan import PlanError, build_plan
from grpo_rollout.rewards import credentials

from tests.support.render import by_kind, container, env, job, rendered

KEYED = {"reward__credentialsSecret": "team-judge-keys"}


def test_only_rollout_pods_mount_the_secret_read_only_and_are_told_where():
    r = rendered(job(**KEYED))
    pod = by_kind(r, "StatefulSet", "moe-rollout")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "reward-credentials"]
    assert volume["secret"] == {"secretName": "team-judge-keys", "defaultMode": 0o440}
    (mount,) = [m for m in container(r, "rollout")["volumeMounts"] if m["name"] == "reward-credentials"]
    assert mount == {"name": "reward-credentials", "mountPath": "/var/run/grpo/reward-credentials",
                     "readOnly": True}  # fmt: skip
    assert env(container(r, "rollout"))["GRPO_REWARD_FILES"] == "/var/run/grpo/reward-credentials"
    assert "GRPO_REWARD_FILES" not in env(container(r, "trainer"))
    assert "team-judge-keys" not in str(by_kind(r, "StatefulSet", "moe-trainer"))
    assert "reward-credentials" not in str(rendered(job()).children)


def test_credential_reads_a_key_and_names_the_field_and_keys_when_it_cannot(tmp_path, monkeypatch):
    monkeypatch.delenv("GRPO_REWARD_FILES", raising=False)
    with pytest.raises(credentials.CredentialError, match=r"spec\.reward\.credentialsSecret is not set"):
        credentials.credential("openai-api-key")
    (tmp_path / "openai-api-key").write_text("sk-1\n")
    (tmp_path / "..data").mkdir()  # what a Secret volume also holds: not a key
    monkeypatch.setenv("GRPO_REWARD_FILES", str(tmp_path))
    assert credentials.credential("openai-api-key") == "sk-1"
    with pytest.raises(
        credentials.CredentialError, match=r"has no key 'anthropic'; its keys: \['openai-api-key'\]"
    ):
        credentials.credential("anthropic")
    for bad in ("../etc/passwd", ".hidden", ""):
        with pytest.raises(credentials.CredentialError, match="is not a key"):
            credentials.credential(bad)


JOB = """\
apiVersion: grpo.dev/v1alpha1
kind: GRPOJob
metadata: {name: keyed}
spec:
  model: {path: model}
  dataset: {path: data.jsonl}
  reward: {functions: [{function: "judge:score"}], credentialsSecret: team-judge-keys}
  rollout: {engine: torch}
"""


def test_a_local_run_takes_the_secrets_files_from_a_folder_of_the_users(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "job.yaml").write_text(JOB)
    monkeypatch.delenv("GRPO_REWARD_FILES", raising=False)
    with pytest.raises(PlanError, match=r"spec\.reward\.credentialsSecret names Secret 'team-judge-keys'.*"
                                        r"set \$GRPO_REWARD_FILES"):  # fmt: skip
        build_plan(tmp_path / "job.yaml", tmp_path / "out")
    keys = tmp_path / "keys"
    keys.mkdir()
    monkeypatch.setenv("GRPO_REWARD_FILES", str(keys))
    plan = build_plan(tmp_path / "job.yaml", tmp_path / "out")
    assert [p.env["GRPO_REWARD_FILES"] for p in plan.rollout] == [str(keys)]
