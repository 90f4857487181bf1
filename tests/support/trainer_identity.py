"""A GRPOJob on the e2e cluster and a client that is its trainer: the trainer ServiceAccount with the
Role the operator renders for it applied, and a TokenRequest token for it. For the e2e tests of what
trainer rank 0 does under the job's own identity (status progress, rollout server discovery).

`crd` (module) is a fixture: the CRD as `grpo-operator crd` prints it, applied and Established.
"""

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from grpo_operator import render
from grpo_operator.api.job import GROUP, PLURAL, VERSION, GRPOJob
from grpo_operator.render import names
from kubernetes import client

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def crd(kubectl: Any, established: Any) -> None:
    text = subprocess.run(
        [sys.executable, "-m", "grpo_operator.cli", "crd"], capture_output=True, text=True, check=True
    ).stdout
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=text)
    established("grpojobs.grpo.dev")


def create_job(api: client.CustomObjectsApi, namespace: str, name: str) -> dict:
    body = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    body["metadata"] = {"name": name}
    return api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def trainer_api(
    k8s_api: client.ApiClient, kubectl: Any, job: dict, namespace: str
) -> client.CustomObjectsApi:
    """A client that is the job's trainer ServiceAccount, with its rendered Role applied."""
    name = job["metadata"]["name"]
    spec = GRPOJob.model_validate({"spec": job["spec"]})
    rendered = render.children(spec, name=name, namespace=namespace, uid=job["metadata"]["uid"])
    rbac = [c for c in rendered if c["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
    account = names.service_account(name, names.ROLE_TRAINER)
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
    core = client.CoreV1Api(k8s_api)
    token = core.create_namespaced_service_account_token(account, namespace, request).status.token
    config = client.Configuration()
    config.host = k8s_api.configuration.host
    config.ssl_ca_cert = k8s_api.configuration.ssl_ca_cert
    config.verify_ssl = k8s_api.configuration.verify_ssl
    config.api_key = {"authorization": f"Bearer {token}"}
    return client.CustomObjectsApi(client.ApiClient(config))
