"""Unit tests of pod template overrides: user additions kept, operator fields win, conflicts reported."""

from grpo_operator.render import overrides

from tests.support.render import by_kind, container, env, job, rendered


def test_user_additions_are_merged():
    j = job(
        trainer__template={
            "metadata": {"labels": {"team": "rl"}, "annotations": {"a": "b"}},
            "spec": {
                "priorityClassName": "high",
                "imagePullSecrets": [{"name": "ecr"}],
                "volumes": [{"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx"}}],
                "containers": [
                    {
                        "name": "trainer",
                        "envFrom": [{"secretRef": {"name": "wandb"}}],
                        "env": [{"name": "X", "value": "1"}],
                    },
                    {"name": "sidecar", "image": "busybox"},
                ],
            },
        }
    )
    r = rendered(j)
    assert r.warnings == []
    tpl = by_kind(r, "StatefulSet", "moe-trainer")["spec"]["template"]
    assert tpl["metadata"]["labels"]["team"] == "rl" and tpl["metadata"]["annotations"] == {"a": "b"}
    assert tpl["spec"]["priorityClassName"] == "high"
    assert [c["name"] for c in tpl["spec"]["containers"]] == ["trainer", "sidecar"]
    t = container(r, "trainer")
    assert env(t)["X"] == "1" and env(t)["FI_PROVIDER"] == "efa"
    assert t["envFrom"] == [{"secretRef": {"name": "wandb"}}]
    assert any(v["name"] == "fsx" for v in tpl["spec"]["volumes"])


def test_operator_fields_win_and_each_conflict_is_reported():
    j = job(
        trainer__template={
            "metadata": {"labels": {"grpo.dev/job": "other"}},
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "env": [{"name": "FI_PROVIDER", "value": "tcp"}],
                        "resources": {"limits": {"vpc.amazonaws.com/efa": "1", "memory": "1Ti"}},
                    }
                ]
            },
        }
    )
    r = rendered(j)
    t = container(r, "trainer")
    assert env(t)["FI_PROVIDER"] == "efa"
    assert t["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32"
    assert t["resources"]["limits"]["memory"] == "1Ti"
    tpl = by_kind(r, "StatefulSet", "moe-trainer")["spec"]["template"]
    assert tpl["metadata"]["labels"]["grpo.dev/job"] == "moe"
    assert len(r.warnings) == 3
    assert any("env[FI_PROVIDER]" in w and "'tcp'" in w for w in r.warnings)
    assert any("vpc.amazonaws.com/efa" in w for w in r.warnings)


def test_merge_lists_by_key_and_values_by_union():
    base = {"tolerations": [{"key": "a"}], "args": ["x"], "ports": [{"containerPort": 1, "name": "p"}]}
    user = {
        "tolerations": [{"key": "b"}, {"key": "a"}],
        "args": ["y"],
        "ports": [{"containerPort": 1, "hostPort": 9}],
    }
    merged, conflicts = overrides.merge(base, user, "spec")
    assert merged["tolerations"] == [{"key": "a"}, {"key": "b"}]
    assert merged["args"] == ["x", "y"]
    assert merged["ports"] == [{"containerPort": 1, "name": "p", "hostPort": 9}]
    assert conflicts == []
    assert base == {
        "tolerations": [{"key": "a"}],
        "args": ["x"],
        "ports": [{"containerPort": 1, "name": "p"}],
    }
