"""Trainer rank 0 follows the rollout servers through the headless Service's EndpointSlices.

A real API server, the job's trainer ServiceAccount with the Role the operator renders for it
(a TokenRequest token), and the trainer's own `EndpointSliceSource`. The slices are written
here as the EndpointSlice controller would for StatefulSet pods (hostnames, ready and
terminating conditions): the source must see servers join, turn ready, terminate and leave,
and ignore another Service's slices. Without the Role's rule the trainer falls back to the
run contract file.
"""

from pathlib import Path
from typing import Any

from grpo_operator.render import names
from grpo_trainer import membership
from kubernetes import client

from tests.support import trainer_identity
from tests.support.rollout import write_contract
from tests.support.trainer_identity import create_job, trainer_api

crd = trainer_identity.crd  # the fixture, by name
PORT = names.ROLLOUT_PORT


def endpoint(
    index: int, *, ready: bool = True, terminating: bool = False, published: bool = False
) -> dict[str, Any]:
    """As the EndpointSlice controller writes a pod; `published`: behind a Service that publishes
    not-ready addresses (servers spanning nodes), where `ready` is always true and `serving` is not."""
    return {
        "addresses": [f"10.0.0.{index + 10}"],
        "hostname": f"disc-rollout-{index}",
        "conditions": {"ready": ready or published, "serving": ready, "terminating": terminating},
    }


def slice_body(name: str, service: str, endpoints: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {membership.SERVICE_NAME_LABEL: service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": PORT, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def test_endpoint_slice_source_sees_joins_readiness_and_leaves(
    crd: None,
    k8s_api: client.ApiClient,
    kubectl: Any,
    namespace: str,
    wait_for: Any,
    tmp_path: Path,
) -> None:
    admin = client.CustomObjectsApi(k8s_api)
    job = create_job(admin, namespace, "disc")
    as_trainer = client.DiscoveryV1Api(trainer_api(k8s_api, kubectl, job, namespace).api_client)
    service = names.statefulset("disc", names.ROLE_ROLLOUT)
    dns = names.service_dns("disc", names.ROLE_ROLLOUT, namespace)
    source = membership.EndpointSliceSource(namespace, service, dns, PORT, api=as_trainer)

    def url(i: int) -> str:
        return f"http://{names.pod_dns('disc', names.ROLE_ROLLOUT, i, namespace)}:{PORT}"

    slices = client.DiscoveryV1Api(k8s_api)
    assert source.read() == []
    # Two pods, one still loading (not ready); another Service's slice must not count.
    slices.create_namespaced_endpoint_slice(
        namespace, slice_body("disc-rollout-a", service, [endpoint(0), endpoint(1, ready=False)])
    )
    slices.create_namespaced_endpoint_slice(namespace, slice_body("other-a", "other-rollout", [endpoint(7)]))
    wait_for(lambda: source.read() == [url(0)], what="only the ready server", timeout=30)
    # A leader of a server spanning nodes, published while it waits for its workers: not serving yet.
    slices.create_namespaced_endpoint_slice(
        namespace, slice_body("disc-rollout-c", service, [endpoint(3, ready=False, published=True)])
    )
    wait_for(lambda: len(slices.list_namespaced_endpoint_slice(namespace).items) == 3, what="slice c")
    assert source.read() == [url(0)]
    slices.delete_namespaced_endpoint_slice("disc-rollout-c", namespace)
    # Pod 1 turns ready and pod 2 joins in a second slice (large Services are split).
    slices.replace_namespaced_endpoint_slice(
        "disc-rollout-a", namespace, slice_body("disc-rollout-a", service, [endpoint(0), endpoint(1)])
    )
    slices.create_namespaced_endpoint_slice(namespace, slice_body("disc-rollout-b", service, [endpoint(2)]))
    wait_for(lambda: source.read() == [url(0), url(1), url(2)], what="three ready servers", timeout=30)
    # Scale down: pod 2 terminates (not ready), then its slice goes; pod 0 is deleted outright.
    slices.replace_namespaced_endpoint_slice(
        "disc-rollout-b",
        namespace,
        slice_body("disc-rollout-b", service, [endpoint(2, ready=False, terminating=True)]),
    )
    slices.replace_namespaced_endpoint_slice(
        "disc-rollout-a", namespace, slice_body("disc-rollout-a", service, [endpoint(1)])
    )
    wait_for(lambda: source.read() == [url(1)], what="one server left", timeout=30)
    slices.delete_namespaced_endpoint_slice("disc-rollout-b", namespace)
    assert source.read() == [url(1)]

    # The trainer's choice: EndpointSlices when its identity may list them ...
    contract_file = write_contract(tmp_path / "job.json", tmp_path, ports=[PORT])
    env = {"GRPO_CONTRACT": str(contract_file), "KUBERNETES_SERVICE_HOST": "in-cluster"}
    from grpo_operator.api.contract import RunContract

    run = RunContract.model_validate_json(contract_file.read_text())
    run = run.model_copy(
        update={
            "namespace": namespace,
            "rollout": run.rollout.model_copy(update={"service": dns, "port": PORT}),
        }
    )
    chosen = membership.choose_source(run, env=env, api=as_trainer)
    assert isinstance(chosen, membership.EndpointSliceSource) and chosen.read() == [url(1)]
    # ... the contract file when it may not (the namespace's default ServiceAccount).
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
    token = (
        client.CoreV1Api(k8s_api)
        .create_namespaced_service_account_token("default", namespace, request)
        .status.token
    )
    config = client.Configuration()
    config.host = k8s_api.configuration.host
    config.ssl_ca_cert = k8s_api.configuration.ssl_ca_cert
    config.verify_ssl = k8s_api.configuration.verify_ssl
    config.api_key = {"authorization": f"Bearer {token}"}
    unprivileged = client.DiscoveryV1Api(client.ApiClient(config))
    fallback = membership.choose_source(run, env=env, api=unprivileged)
    assert isinstance(fallback, membership.ContractFileSource)
