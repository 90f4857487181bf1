"""What an EFA pod checks at start-up (issue 45, first contact): NCCL GIN's prerequisites, the locked-
memory limit, DeepEP's import, each stated as a reason the job's status shows. The pure parts over
given facts; the probe and the import on this machine, for real (it has no EFA, no GDRCopy)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.api.status import GRPOJobStatus, Phase, Reason
from grpo_operator.controller import observe, status
from grpo_rollout import preflight
from grpo_rollout.engines import vllm_deepep
from grpo_wire import efa

from tests.support.render import SEED_SERVER, container, env, job, rendered

UNLIMITED = resource.RLIM_INFINITY
GOOD = efa.NodeFacts(
    gdrdrv=True,
    gdrcopy=(2, 5),
    net_plugin="/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so",
    net_plugin_name="libnccl-net-ofi.so",
    rdma_devices=16,
    memlock=(UNLIMITED, UNLIMITED),
)
EFA_ENV = {"FI_PROVIDER": "efa", "NCCL_NET_PLUGIN": "ofi", "NCCL_GIN_PLUGIN": "ofi", "NCCL_GIN_TYPE": "2"}
ACROSS = SEED_SERVER  # all2allBackend auto resolves to deepep_v2 for it


def replace(facts: efa.NodeFacts, **fields) -> efa.NodeFacts:
    return efa.NodeFacts(**(facts.__dict__ | fields))


def test_a_node_with_every_gin_prerequisite_has_no_problem() -> None:
    assert efa.gin_problems(GOOD) == [] and efa.memlock_problems(GOOD) == []


def test_each_missing_gin_prerequisite_is_named() -> None:
    assert "/dev/gdrdrv is missing" in efa.gin_problems(replace(GOOD, gdrdrv=False))[0]
    assert "NVIDIA_GDRCOPY=enabled" in efa.gin_problems(replace(GOOD, gdrdrv=False))[0]
    old = efa.gin_problems(replace(GOOD, gdrcopy=(2, 4)))
    assert old == ["GDRCopy 2.4 is loaded; aws-ofi-nccl's GIN needs >= 2.5"]
    gone = efa.gin_problems(replace(GOOD, gdrcopy="libgdrapi.so.2: cannot open shared object file"))
    assert gone[0].startswith("GDRCopy's library libgdrapi.so.2 does not load: libgdrapi.so.2: cannot open")
    assert efa.gin_problems(replace(GOOD, net_plugin=None)) == [
        "NCCL's net plugin libnccl-net-ofi.so is not on LD_LIBRARY_PATH"
    ]
    assert len(efa.gin_problems(replace(GOOD, gdrdrv=False, net_plugin=None))) == 2


def test_a_finite_memlock_limit_fails_an_efa_pod_and_nothing_else() -> None:
    low = replace(GOOD, memlock=(64 << 10, 64 << 10))
    (problem,) = efa.memlock_problems(low)
    assert "RLIMIT_MEMLOCK is 65536 bytes with 16 EFA devices" in problem and "IPC_LOCK" in problem
    assert efa.memlock_problems(replace(low, rdma_devices=0)) == []  # no EFA device: nothing to pin


def test_the_net_plugin_file_is_what_nccl_loads_for_its_setting(tmp_path: Path) -> None:
    assert efa.net_plugin_file({"NCCL_NET_PLUGIN": "ofi"}) == "libnccl-net-ofi.so"
    assert efa.net_plugin_file({}) == "libnccl-net.so"
    assert efa.net_plugin_file({"NCCL_NET_PLUGIN": "libnccl-net-aws.so"}) == "libnccl-net-aws.so"
    (tmp_path / "libnccl-net-ofi.so").write_bytes(b"")
    found = efa.find_library("libnccl-net-ofi.so", {"LD_LIBRARY_PATH": f"/nowhere:{tmp_path}"})
    assert found == str(tmp_path / "libnccl-net-ofi.so")
    assert efa.find_library("libnccl-net-ofi.so", {"LD_LIBRARY_PATH": "/nowhere"}) is None


def test_this_machines_probe_finds_no_gin_and_says_what_is_missing() -> None:
    facts = efa.probe({**EFA_ENV, "LD_LIBRARY_PATH": "/nowhere"})
    assert not facts.gdrdrv and isinstance(facts.gdrcopy, str)  # no GDRCopy here
    assert facts.memlock[0] == resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    assert len(efa.gin_problems(facts)) == 3


def test_deepep_counts_are_one_place_for_trainer_and_rollout() -> None:
    assert efa.deepep_counts({"FI_PROVIDER": "efa"}) == (efa.EFA_SMS, efa.EFA_QPS) == (12, 2)
    assert efa.deepep_counts({}) == (None, None)
    assert efa.deepep_counts({"GRPO_DEEPEP_NUM_QPS": "4"}) == (None, 4)
    with pytest.raises(ValueError, match="GRPO_DEEPEP_NUM_SMS must be a positive integer, got 'x'"):
        efa.deepep_counts({"GRPO_DEEPEP_NUM_SMS": "x"})


def spec(**rollout) -> GRPOJobSpec:
    return job(rollout=ACROSS | rollout).spec


def test_a_rollout_pod_without_deepep_states_the_field_the_backend_and_why() -> None:
    env: dict[str, str] = dict(EFA_ENV)
    found = preflight.problems(
        spec(), env, facts=lambda: GOOD, importer=lambda api: "No module named 'deep_ep'"
    )
    assert found == (
        Reason.EP_BACKEND_UNAVAILABLE,
        "rollout.vllm.all2allBackend deepep_v2 (resolved from auto) cannot run in this pod: "
        "No module named 'deep_ep'; or set rollout.vllm.all2allBackend allgather_reducescatter to run "
        "without DeepEP",
    )
    assert env[vllm_deepep.ENV] == "deepep_v2"  # what vLLM's processes read


def test_a_rollout_pod_without_gdrcopy_states_what_gin_lacks_and_memlock_comes_first() -> None:
    bare = replace(GOOD, gdrdrv=False)
    found = preflight.problems(spec(), dict(EFA_ENV), facts=lambda: bare, importer=lambda api: None)
    assert found is not None and found[0] == Reason.EP_BACKEND_UNAVAILABLE
    assert found[1].startswith("rollout.vllm.all2allBackend deepep_v2 (resolved from auto) needs NCCL GIN")
    assert "/dev/gdrdrv is missing" in found[1]
    low = replace(bare, memlock=(8 << 20, 8 << 20))
    found = preflight.problems(spec(), dict(EFA_ENV), facts=lambda: low, importer=lambda api: None)
    assert found is not None and found[0] == Reason.EFA_MISCONFIGURED and "RLIMIT_MEMLOCK" in found[1]


def test_a_rollout_pod_that_moves_no_tokens_over_deepep_checks_no_deepep() -> None:
    asked: list[str] = []
    env: dict[str, str] = dict(EFA_ENV)
    inside = {"nodesPerServer": 1, "instanceType": "p5en.48xlarge", "tensorParallelSize": 2,
              "vllm": {"dataParallelSize": 4, "expertParallelSize": 8}}  # fmt: skip
    one_node = job(rollout=inside).spec  # auto: vLLM's own allgather_reducescatter
    assert preflight.problems(one_node, env, facts=lambda: GOOD, importer=asked.append) is None
    assert asked == [] and vllm_deepep.ENV not in env
    named = job(rollout=inside | {"vllm": inside["vllm"] | {"all2allBackend": "deepep_low_latency"}}).spec
    assert preflight.problems(named, env, facts=lambda: GOOD, importer=lambda api: asked.append(api)) is None
    assert asked == ["Buffer"] and env[vllm_deepep.ENV] == "deepep_low_latency"


STAND_IN = textwrap.dedent(
    """
    raise AssertionError("Duplicate NCCL runtime found in the current system: a and b")
    """
)


def test_the_import_runs_in_a_fresh_interpreter_and_its_refusal_is_the_why(tmp_path: Path) -> None:
    (tmp_path / "deep_ep").mkdir()
    (tmp_path / "deep_ep" / "__init__.py").write_text(STAND_IN)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    try:
        why = preflight.import_in_child("ElasticBuffer")
    finally:
        os.environ["PYTHONPATH"] = os.environ["PYTHONPATH"].split(os.pathsep, 1)[1]
    assert (
        why
        == "deep_ep does not import (AssertionError: Duplicate NCCL runtime found in the current system: "
        + ("a and b)")
    )


@pytest.mark.slow
def test_the_rollout_command_exits_with_the_stated_reason_before_any_engine(tmp_path: Path) -> None:
    """`python -m grpo_rollout serve` on a pod whose image has no DeepEP (this machine): exit 3 and
    the stated reason on stderr, before it reads the model."""
    r = rendered(job(rollout=ACROSS))
    contract = tmp_path / "job.json"
    contract.write_text(r.contract.model_dump_json(by_alias=True))
    pod_env = {k: v for k, v in env(container_of_leader(r)).items() if isinstance(v, str)}
    run_env = dict(os.environ, **{k: v for k, v in pod_env.items() if k in EFA_ENV}, GRPO_TOKEN="t")
    done = subprocess.run(
        [sys.executable, "-m", "grpo_rollout", "serve", "--contract", str(contract)],
        env=run_env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert "EPBackendUnavailable: rollout.vllm.all2allBackend deepep_v2 (resolved from auto)" in done.stderr


def container_of_leader(r) -> dict:
    lws = next(c for c in r.children if c["kind"] == "LeaderWorkerSet")
    pod = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    return next(c for c in pod["spec"]["containers"] if c["name"] == "rollout")


def test_gin_pods_ask_the_container_toolkit_for_gdrcopy_and_others_do_not() -> None:
    r = rendered(job(rollout=ACROSS))
    lws = next(c for c in r.children if c["kind"] == "LeaderWorkerSet")
    for member in ("leaderTemplate", "workerTemplate"):
        pod = lws["spec"]["leaderWorkerTemplate"][member]
        c = next(c for c in pod["spec"]["containers"] if c["name"] == "rollout")
        assert env(c)["NVIDIA_GDRCOPY"] == "enabled", member
    assert env(container(r, "trainer"))["NVIDIA_GDRCOPY"] == "enabled"  # EP 16 over 2 pods, auto
    one_pod_ep = rendered(
        job(trainer={"replicas": 2, "instanceType": "p5.48xlarge", "expertParallelSize": 8})
    )
    assert "NVIDIA_GDRCOPY" not in env(container(one_pod_ep, "trainer"))  # EP inside a node: no GIN
    assert "NVIDIA_GDRCOPY" not in env(container(one_pod_ep, "rollout"))  # one node, no all2all
    nccl = rendered(job(trainer__epBackend="nccl"))
    assert "NVIDIA_GDRCOPY" not in env(container(nccl, "trainer"))


def failed_rollout_pod(message: str, code: int = 3) -> dict:
    return {
        "metadata": {
            "name": "moe-rollout-0",
            "labels": {"grpo.dev/role": "rollout", "grpo.dev/job-uid": "uid-1"},
        },
        "spec": {"nodeName": "n1"},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "rollout",
                    "lastState": {"terminated": {"exitCode": code, "reason": "Error", "message": message}},
                }
            ],
        },
    }


def test_a_rollout_pod_that_states_why_it_cannot_start_fails_the_job_with_it() -> None:
    from datetime import UTC, datetime

    stated = (
        "EPBackendUnavailable: rollout.vllm.all2allBackend deepep_v2 (resolved from auto) needs NCCL GIN "
        "over EFA, which lacks: /dev/gdrdrv is missing"
    )
    obs = observe.summarize([failed_rollout_pod(stated)], attempt=0)
    d = status.decide(spec=job().spec, generation=1, old=GRPOJobStatus(), obs=obs, now=datetime.now(UTC))
    failed = next(c for c in d.status.conditions if c.type == "Failed")
    assert (d.status.phase, failed.reason) == (Phase.FAILED, Reason.EP_BACKEND_UNAVAILABLE)
    assert (
        failed.message
        == f"rollout server pod moe-rollout-0 cannot serve as configured: {stated.split(': ', 1)[1]}"
    )
    plain = observe.summarize(
        [failed_rollout_pod("rollout: model directory '/m' does not exist", 3)], attempt=0
    )
    d = status.decide(spec=job().spec, generation=1, old=GRPOJobStatus(), obs=plain, now=datetime.now(UTC))
    assert d.status.phase != Phase.FAILED  # no stated reason: the pod is replaced as before


def test_a_trainer_states_what_gin_lacks_so_deepep_is_refused_and_auto_says_why() -> None:
    from grpo_trainer.moe.backends import deepep_v2

    why = deepep_v2.gin_missing(dict(EFA_ENV), replace(GOOD, gdrdrv=False, net_plugin=None))
    assert why is not None and why.startswith("NCCL GIN over EFA lacks: /dev/gdrdrv is missing")
    assert "libnccl-net-ofi.so is not on LD_LIBRARY_PATH" in why
    assert deepep_v2.gin_missing(dict(EFA_ENV), GOOD) is None
    assert deepep_v2.gin_missing({}, replace(GOOD, gdrdrv=False)) is None  # no GIN through aws-ofi-nccl


def test_a_trainer_rank_on_an_efa_node_that_cannot_pin_memory_fails_with_the_reason() -> None:
    from grpo_trainer.__main__ import check_efa
    from grpo_trainer.config import ConfigError

    low = replace(GOOD, memlock=(8 << 20, 8 << 20))
    with pytest.raises(ConfigError) as e:
        check_efa({"FI_PROVIDER": "efa"}, lambda: low)
    assert e.value.stated().startswith(
        "EFAMisconfigured: RLIMIT_MEMLOCK is 8388608 bytes with 16 EFA devices"
    )
    check_efa({}, lambda: low)  # not an EFA pod: nothing to pin
    check_efa({"FI_PROVIDER": "efa"}, lambda: GOOD)
