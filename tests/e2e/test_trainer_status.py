"""Trainer rank 0 reports progress into the GRPOJob status under the job's own identity.

The Role the operator renders for the trainer ServiceAccount must allow exactly this patch
(and nothing on other jobs), and the patch must pass the CRD's status schema: a real API
server, a real TokenRequest token for that ServiceAccount, the trainer's own StatusPatcher.
"""

from typing import Any

import pytest
from grpo_operator.api.job import GROUP, PLURAL, VERSION
from grpo_operator.api.report import AttemptStart
from grpo_trainer.progress import StatusPatcher
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.support import trainer_identity
from tests.support.progress import REPORT
from tests.support.trainer_identity import create_job, trainer_api

crd = trainer_identity.crd  # the fixture, by name


def test_rank0_progress_lands_in_status_and_only_for_its_own_job(
    crd: None, k8s_api: client.ApiClient, kubectl: Any, namespace: str, wait_for: Any
) -> None:
    admin = client.CustomObjectsApi(k8s_api)
    job = create_job(admin, namespace, "reporter")
    other = create_job(admin, namespace, "neighbour")
    as_trainer = trainer_api(k8s_api, kubectl, job, namespace)

    patcher = StatusPatcher(namespace, "reporter", api=as_trainer)
    save = "s3://ckpt/ns/first-u1/step-00000040"
    patcher.submit(AttemptStart(resumed_from_step=40, resumed_from=save, time=1.7e9).to_progress_patch())

    def started() -> bool:
        got = admin.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "reporter")
        return (got.get("status") or {}).get("progress", {}).get("resumedFrom") == save

    wait_for(started, what="status.progress.resumedFrom written at the attempt's start", timeout=30)
    report = REPORT.model_copy(update={"step": 7, "reward_mean": 0.625, "weight_version": 7})
    patcher.submit(report.to_progress().wire())  # every progress field, through the CRD's schema

    def reported() -> bool:
        got = admin.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "reporter")
        return (got.get("status") or {}).get("progress", {}).get("step") == 7

    wait_for(reported, what="status.progress.step == 7 written with the trainer's identity", timeout=30)
    status = admin.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "reporter")["status"]
    assert status["progress"]["rewardMean"] == 0.625 and status["progress"]["weightVersion"] == 7
    assert status["progress"]["epAllToAllSeconds"] == REPORT.ep_all_to_all_s

    body = {"status": {"progress": {"step": 99}}}
    with pytest.raises(ApiException) as denied:
        as_trainer.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, other["metadata"]["name"], body
        )
    assert denied.value.status == 403
    with pytest.raises(ApiException) as spec_denied:
        as_trainer.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "reporter", {"spec": {}})
    assert spec_denied.value.status == 403
