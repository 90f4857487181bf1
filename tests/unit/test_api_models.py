"""The GRPOJob API models: defaults, strictness, bounds and the documentation every field carries."""

import typing

import pytest
from grpo_operator.api import contract, job, spec, status
from pydantic import BaseModel, ValidationError

MINIMAL = {
    "apiVersion": "grpo.dev/v1alpha1",
    "kind": "GRPOJob",
    "metadata": {"name": "tiny"},
    "spec": {
        "model": {"path": "/models/tiny"},
        "dataset": {"path": "data/prompts.jsonl"},
        "reward": {"functions": [{"builtin": "exact_match"}]},
    },
}


def _models(root: type[BaseModel]) -> set[type[BaseModel]]:
    """Every model reachable from `root` through its fields' annotations."""
    found: set[type[BaseModel]] = set()
    todo: list[typing.Any] = [root]
    while todo:
        hint = todo.pop()
        if isinstance(hint, type) and issubclass(hint, BaseModel):
            if hint in found:
                continue
            found.add(hint)
            todo += [f.annotation for f in hint.model_fields.values()]
        else:
            todo += list(typing.get_args(hint))
    return found


def test_minimal_job_fills_documented_defaults() -> None:
    j = job.GRPOJob.model_validate(MINIMAL)
    assert (
        j.spec.trainer.replicas,
        j.spec.trainer.processes_per_pod,
        j.spec.trainer.expert_parallel_size,
    ) == (1, 8, 1)
    assert j.spec.algorithm.group_size == 8
    assert j.spec.algorithm.policy_loss == "grpo"
    assert j.spec.rollout.engine == "vllm"
    assert j.spec.network.efa == "auto"
    assert j.spec.model.dtype == "bfloat16"


def test_wire_is_camel_case_and_leaves_unset_optionals_out() -> None:
    wire = job.GRPOJob.model_validate(MINIMAL).wire()
    assert wire["spec"]["trainer"]["processesPerPod"] == 8
    assert "instanceType" not in wire["spec"]["trainer"]
    assert "overlongPenalty" not in wire["spec"]["algorithm"]
    assert "status" not in wire
    assert job.GRPOJob.model_validate(wire).wire() == wire


@pytest.mark.parametrize(
    ("where", "value"),
    [
        (("trainer", "replica"), 2),  # unknown field
        (("algorithm", "groupSize"), 1),  # below 2
        (("algorithm", "learningRate"), 0),  # exclusive minimum
        (("trainer", "epBackend"), "mpi"),  # not in the enum
        (("trainer", "tolerations"), [{"operator": "Equals"}]),  # Exists or Equal only
        (("network", "hugepages"), "5G"),  # pattern
        (("trainer", "instanceType"), "p5 48xlarge"),  # pattern
        (("runPolicy", "activeDeadlineSeconds"), 300000000000),  # past 10 years: datetime overflow
        (("runPolicy", "ttlSecondsAfterFinished"), 10**15),
        (("algorithm", "seed"), 2**32),  # past what numpy seeds
        (("rollout", "maxBatchSize"), 65537),
    ],
)
def test_models_reject_bad_fields(where: tuple[str, str], value: object) -> None:
    data = {**MINIMAL["spec"], where[0]: {where[1]: value}}
    with pytest.raises(ValidationError) as err:
        spec.GRPOJobSpec.model_validate(data)
    assert err.value.errors()[0]["loc"][:2] == where


def test_paths_accept_local_pvc_and_s3_but_not_urls() -> None:
    for good in ("/models/m", "./m", "models/m", "pvc://models-claim/qwen", "s3://my-bucket/qwen3/"):
        spec.ModelSpec(path=good)
    for bad in ("https://huggingface.co/Qwen/Qwen3", "s3://Bucket/x", "pvc://Claim_1/x", "gs://b/x"):
        with pytest.raises(ValidationError):
            spec.ModelSpec(path=bad)


def test_every_field_is_documented_starting_with_its_wire_name() -> None:
    models = _models(job.GRPOJob) | _models(contract.RunContract)
    assert spec.TrainerSpec in models and status.Condition in models
    for model in models:
        for name, info in model.model_fields.items():
            wire = info.alias or name
            assert info.description, f"{model.__name__}.{name} has no description"
            assert info.description.startswith(f"{wire}:"), f"{model.__name__}.{name}: {info.description!r}"


def test_status_round_trips_with_conditions_and_progress() -> None:
    st = status.GRPOJobStatus.model_validate(
        {
            "phase": "Running",
            "conditions": [{"type": "Running", "status": "True", "reason": status.Reason.ALL_READY}],
            "trainer": {"replicas": 2, "ready": 2, "readyText": "2/2"},
            "progress": {"step": 7, "rewardMean": 0.5, "tokensPerSecond": 1200.0},
        }
    )
    assert st.phase == status.Phase.RUNNING
    assert st.wire()["conditions"][0]["reason"] == "AllReplicasReady"
    assert st.wire()["progress"]["rewardMean"] == 0.5
    with pytest.raises(ValidationError):
        status.GRPOJobStatus.model_validate({"phase": "Exploded"})


def test_name_rule_leaves_room_for_child_suffixes() -> None:
    longest_child = "x" * job.MAX_NAME_LENGTH + "-trainer"
    assert len(longest_child) + 11 <= 63  # StatefulSet name + controller-revision-hash suffix
