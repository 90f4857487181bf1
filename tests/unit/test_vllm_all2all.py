"""spec.rollout.vllm.all2allBackend: resolved from the layout by one function, which the rollout pods'
annotation, the job's status and the engine's vLLM arguments all read."""

import pytest
from grpo_operator import render
from grpo_operator.api.roles import RolloutSpec, resolve_all2all
from grpo_operator.api.spec import GRPOJobSpec

from tests.support.render import by_kind, job, rendered
from tests.support.status import all_ready, decide

WIDE = {
    "instanceType": "p5.48xlarge",
    "tensorParallelSize": 2,
    "vllm": {"dataParallelSize": 4, "expertParallelSize": 8},
}


def rollout(**fields) -> RolloutSpec:
    return RolloutSpec.model_validate(WIDE | fields)


def test_auto_is_vllms_own_default_inside_one_node_and_deepep_v2_across_nodes() -> None:
    assert resolve_all2all(rollout()) == "allgather_reducescatter"
    across = rollout(nodesPerServer=2, vllm={"dataParallelSize": 8, "expertParallelSize": 16})
    assert resolve_all2all(across) == "deepep_v2"


def test_a_named_backend_is_kept_and_none_where_no_tokens_move_between_gpus() -> None:
    named = rollout(vllm=WIDE["vllm"] | {"all2allBackend": "deepep_low_latency"})
    named_across = rollout(
        nodesPerServer=2,
        vllm={"dataParallelSize": 8, "expertParallelSize": 16, "all2allBackend": "deepep_low_latency"},
    )
    assert resolve_all2all(named) == resolve_all2all(named_across) == "deepep_low_latency"
    assert resolve_all2all(rollout(vllm={"dataParallelSize": 4})) is None  # no expert parallelism
    assert resolve_all2all(rollout(vllm={"expertParallelSize": 2}, tensorParallelSize=2)) is None  # no DP
    assert resolve_all2all(rollout(engine="torch", vllm={})) is None


def test_the_rollout_pods_carry_the_resolved_backend_and_trainer_pods_do_not() -> None:
    pods = rendered(job(rollout={"replicas": 2} | WIDE))
    rollout_sts = by_kind(pods, "StatefulSet", "moe-rollout")
    annotations = rollout_sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["grpo.dev/vllm-all2all-backend"] == "allgather_reducescatter"
    trainer_sts = by_kind(pods, "StatefulSet", "moe-trainer")
    assert "grpo.dev/vllm-all2all-backend" not in trainer_sts["spec"]["template"]["metadata"].get(
        "annotations", {}
    )
    plain = by_kind(rendered(), "StatefulSet", "moe-rollout")["spec"]["template"]["metadata"]
    assert "grpo.dev/vllm-all2all-backend" not in plain.get("annotations", {})


@pytest.mark.parametrize("instance_type", ["g6e.xlarge", None])
def test_deepep_v2_on_rollout_nodes_without_efa_is_refused_naming_the_field(
    instance_type: str | None,
) -> None:
    spec = {"replicas": 1} | WIDE | {"vllm": WIDE["vllm"] | {"all2allBackend": "deepep_v2"}}
    spec = (
        spec | {"instanceType": instance_type}
        if instance_type
        else {k: v for k, v in spec.items() if k != "instanceType"}
    )
    with pytest.raises(render.RenderError, match=r"rollout.vllm.all2allBackend deepep_v2 .* no EFA devices"):
        rendered(job(rollout=spec))


def test_status_says_what_the_servers_run() -> None:
    spec = GRPOJobSpec.model_validate(
        {
            "model": {"path": "/m"},
            "dataset": {"path": "/d"},
            "reward": {"functions": [{"builtin": "math"}]},
            "trainer": {"replicas": 2, "processesPerPod": 1},
            "rollout": {"replicas": 2} | WIDE,
        }
    )
    status = decide(all_ready(), s=spec).status
    assert status.rollout_all2all_backend == "allgather_reducescatter"
    assert status.wire()["rolloutAll2allBackend"] == "allgather_reducescatter"
    assert decide(all_ready()).status.rollout_all2all_backend is None
