"""spec.rollout.weightSync from the spec to the pods: which transport a job gets, the port in the
run contract, and NetworkPolicies that let trainer and rollout pods reach each other only when
weights are streamed over a collective group."""

import pytest
from grpo_operator import render
from grpo_operator.render import names
from grpo_trainer.weight_sync import transport

from tests.support.render import by_kind, job, rendered


def ingress_from(r: render.Rendered, role: str) -> list[str]:
    """The roles (by selector) that may reach `role`'s pods on any port."""
    rules = by_kind(r, "NetworkPolicy", f"moe-{role}")["spec"]["ingress"]
    return sorted(
        peer["podSelector"]["matchLabels"]["grpo.dev/role"]
        for rule in rules
        if "ports" not in rule
        for peer in rule["from"]
        if "podSelector" in peer
    )


@pytest.mark.parametrize(
    ("engine", "chosen", "streams"),
    [
        ("torch", "auto", True),
        ("vllm", "auto", True),
        ("vllm", "collective", True),
        ("torch", "http", False),
    ],
)
def test_auto_streams_with_every_engine_and_http_is_explicit(engine, chosen, streams):
    j = job(rollout__engine=engine, rollout__weightSync={"transport": chosen})
    assert j.spec.rollout.streams_weights is streams
    contract = render.contract(j, name="moe", namespace="team")
    assert contract.trainer.weight_sync_port == names.WEIGHT_SYNC_PORT
    assert transport(contract) == ("collective" if streams else "http")
    r = rendered(j)
    assert ingress_from(r, "trainer") == (["rollout", "trainer"] if streams else ["trainer"])
    assert ingress_from(r, "rollout") == (["trainer"] if streams else [])


def test_a_contract_without_a_weight_sync_port_falls_back_to_http_unless_collective_was_asked():
    ports = render.LocalPorts(trainer_master_port=29500, rollout_ports=(8000, 8001))
    auto = render.contract(job(rollout__engine="torch"), name="j", namespace="n", local_ports=ports)
    assert transport(auto) == "http"
    asked = job(rollout__engine="torch", rollout__weightSync={"transport": "collective"})
    with pytest.raises(ValueError, match="weightSyncPort"):
        transport(render.contract(asked, name="j", namespace="n", local_ports=ports))


def test_bucket_size_is_bounded():
    with pytest.raises(ValueError, match="bucketMb"):
        job(rollout__weightSync={"bucketMb": 4096})
