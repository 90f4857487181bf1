"""A GRPOJob and its rendering, for the tests of the renderer, its overrides and its consumers."""

import copy

from grpo_operator import render
from grpo_operator.api.job import GRPOJob

BASE = {
    "apiVersion": "grpo.dev/v1alpha1",
    "kind": "GRPOJob",
    "metadata": {"name": "moe", "namespace": "team"},
    "spec": {
        "model": {"path": "pvc://models/qwen3-moe"},
        "dataset": {"path": "s3://bucket/gsm8k.jsonl"},
        "reward": {"functions": [{"builtin": "math"}]},
        "checkpoint": {"path": "pvc://ckpt/runs"},
        "trainer": {"replicas": 2, "instanceType": "p5.48xlarge", "expertParallelSize": 16},
        "rollout": {"replicas": 2, "instanceType": "p5.48xlarge", "tensorParallelSize": 8},
    },
}


# The seed's rollout server (examples/p5en-deepseek-v3.yaml): 4 p5en nodes, TP 1 x DP 32, experts over
# all 32 GPUs; all2allBackend auto resolves to deepep_v2 for it.
SEED_SERVER = {
    "replicas": 1,
    "instanceType": "p5en.48xlarge",
    "nodesPerServer": 4,
    "tensorParallelSize": 1,
    "vllm": {"dataParallelSize": 32, "expertParallelSize": 32},
}


def job(**spec_updates) -> GRPOJob:
    """BASE (a two-pod p5 job) with spec fields replaced by path: `job(trainer__replicas=4)`."""
    raw = copy.deepcopy(BASE)
    for path, value in spec_updates.items():
        node = raw["spec"]
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return GRPOJob.model_validate(raw)


def rendered(j: GRPOJob | None = None, **kw) -> render.Rendered:
    """What the operator renders for `j` (default BASE) as job moe in namespace team."""
    return render.render(j or job(), name="moe", namespace="team", uid="uid-1", **kw)


def by_kind(r: render.Rendered, kind: str, name: str | None = None) -> dict:
    """The one child of `kind` (and `name`); fails when there is none or several."""
    found = [c for c in r.children if c["kind"] == kind and (name is None or c["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def container(r: render.Rendered, role: str) -> dict:
    return by_kind(r, "StatefulSet", f"moe-{role}")["spec"]["template"]["spec"]["containers"][0]


def env(c: dict) -> dict:
    """A container's env as name -> value (or valueFrom)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
