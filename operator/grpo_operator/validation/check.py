"""Offline validation of GRPOJob manifests that reaches the API server's verdicts.

Called by `grpo-operator validate` and by the tests that hold it to a real API server.
It follows kube-apiserver's steps for a custom resource, in order: YAML to JSON (as
kubectl converts it), non-nullable nulls pruned and schema defaults applied from the
generated CRD, the OpenAPI schema checked (by the pydantic models the schema is generated
from, in strict mode, and inside the embedded PodSpecs, plain dicts to the models, by the
CRD's schema itself: `structural`), then every `x-kubernetes-validations` rule of the CRD evaluated with
cel-python on the defaulted object; transition rules (`oldSelf`) only when an old object is
given. Rules are read from the CRD, never re-implemented here. Beyond the server's verdicts, a
valid job is held to the memory plan when its model's config.json is reachable from here
(`memory_problems`): a trainer that cannot fit on its GPUs is an error, as the trainer refuses it
at start, with the same message; and to the renderer's own checks against the instance-type table
(`render_problems`: a layout that does not fill its nodes, deepep_v2 without EFA...), which CEL
cannot see and the operator would fail the job with.
"""

import functools
import json
import sys
from pathlib import Path
from typing import Any

import pydantic

from grpo_operator import crd, instance_types, memory_plan, render
from grpo_operator.api import job
from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.validation import escalation
from grpo_operator.validation import paths as path_checks
from grpo_operator.validation.cel import cel_problems
from grpo_operator.validation.schema import apply_defaults, metadata_problems, schema_problems
from grpo_operator.validation.structural import embedded_problems
from grpo_operator.validation.yaml_docs import Path_, Problem, dotted, json_value, load_documents


def is_grpojob(obj: Any) -> bool:
    """Documents of other kinds (ConfigMaps, PVCs next to a job) are not ours to judge."""
    if not isinstance(obj, dict):
        return False
    api = obj.get("apiVersion")
    return obj.get("kind") == job.KIND or (isinstance(api, str) and api.startswith(f"{job.GROUP}/"))


def _identity(obj: dict[str, Any]) -> tuple[Any, Any]:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return meta.get("namespace"), meta.get("name")


@functools.cache
def _schema() -> dict[str, Any]:
    return crd.openapi_schema()


def check_object(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[tuple[Path_, str]]:
    """All problems of one GRPOJob object (an update of `old` when given), as (path, message)."""
    if obj.get("apiVersion") != job.API_VERSION or obj.get("kind") != job.KIND:
        got = f"{obj.get('apiVersion')}, Kind={obj.get('kind')}"
        return [((), f"no matches for {got}: want apiVersion {job.API_VERSION}, kind {job.KIND}")]
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not (name or meta.get("generateName")):
        return [(("metadata", "name"), "Required value: name or generateName is required")]
    out = metadata_problems(meta)
    schema = _schema()
    new = {k: json_value(v) for k, v in obj.items() if k != "status"}
    if not name:  # the server validates the name it generates: generateName (cut to 58) + 5 characters
        new["metadata"]["name"] = f"{str(meta['generateName'])[:58]}x7b2q"
    apply_defaults(new, schema)
    problems, blocking = schema_problems(new)
    embedded, embedded_blocking = embedded_problems(new, schema)  # template.spec: dicts to the models
    out += problems + embedded
    blocking |= embedded_blocking
    if not blocking:
        if old is not None:
            old = {k: json_value(v) for k, v in old.items() if k != "status"}
            apply_defaults(old, schema)
        out += cel_problems(new, schema, (), old, old is not None)
    return out


def validate_text(
    text: str, file: str = "<stdin>", old_text: str | None = None, old_file: str = "<old>"
) -> list[Problem]:
    """Every problem of every GRPOJob in `text`; with `old_text`, same-named jobs are checked as updates."""
    docs, problems = load_documents(text, file)
    olds: dict[tuple[Any, Any], dict[str, Any]] = {}
    if old_text is not None:
        old_docs, old_problems = load_documents(old_text, old_file)
        problems += old_problems
        olds = {_identity(d.data): d.data for d in old_docs if is_grpojob(d.data)}
    jobs = [d for d in docs if is_grpojob(d.data)]
    for doc in jobs:
        found = [
            Problem(file, doc.line(path), dotted(path), message)
            for path, message in check_object(doc.data, olds.get(_identity(doc.data)))
        ]
        problems += sorted(found, key=lambda p: p.line)
    if not jobs and not problems:
        problems.append(Problem(file, 1, "<file>", f"no {job.KIND} ({job.API_VERSION}) document found"))
    return problems


def escalation_warnings(text: str, file: str = "<stdin>") -> list[Problem]:
    """What each GRPOJob in `text` asks beyond what GRPOJob `create` grants (`escalation.refusals`):
    valid for the CRD, but refused by the chart's admission policy unless the requester may escalate."""
    docs, _ = load_documents(text, file)
    out = []
    for doc in docs:
        if not is_grpojob(doc.data):
            continue
        try:
            model = job.GRPOJob.model_validate(doc.data)
        except pydantic.ValidationError:
            continue  # validate_text says why
        meta = doc.data.get("metadata") if isinstance(doc.data.get("metadata"), dict) else {}
        annotations = meta.get("annotations") if isinstance(meta.get("annotations"), dict) else {}
        for refusal in escalation.refusals(model, annotations):
            path, _, message = refusal.partition(": ")
            out.append(Problem(file, doc.line(tuple(path.split("[", 1)[0].split("."))), path, message))
    return out


def render_problems(text: str, file: str = "<stdin>") -> list[Problem]:
    """What the operator's renderer refuses in each GRPOJob of `text` (`render.validate`, against the
    instance-type table), at the line of the field its message starts with (`rollout.nodesPerServer
    ...`), else of the spec."""
    docs, _ = load_documents(text, file)
    table = instance_types.load()
    out = []
    for doc in docs:
        if not is_grpojob(doc.data):
            continue
        try:
            parsed = job.GRPOJob.model_validate(doc.data)
        except pydantic.ValidationError:
            continue  # validate_text says why
        meta = doc.data.get("metadata") or {}
        name = str(meta.get("name") or meta.get("generateName") or "job")
        try:
            render.validate(
                parsed, name=name, namespace=str(meta.get("namespace") or "default"), instance_types=table
            )
        except render.RenderError as e:
            where = _field_of(str(e), doc.data.get("spec") or {})
            out.append(Problem(file, doc.line(where), dotted(where), str(e)))
    return out


def _field_of(message: str, spec: dict) -> Path_:
    """The spec path a render message starts with (`rollout.vllm.all2allBackend deepep_v2 ...`), as
    far as the manifest has it; `spec` when it names none."""
    path: tuple[str, ...] = ("spec",)
    node: Any = spec
    for part in message.split(" ", 1)[0].rstrip(":,").split("."):
        if not isinstance(node, dict) or part not in node:
            break
        path, node = (*path, part), node[part]
    return path


def memory_problems(
    text: str, file: str = "<stdin>", model_config: Path | None = None
) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings) of the memory plan for each GRPOJob in `text`, against its instance types.

    The model's config.json is `model_config`, else `spec.model.path` when that is a local directory
    (relative paths: also to the manifest's folder). A trainer that cannot fit is an error with the
    message the trainer's start-up check (`grpo_trainer.memory`) raises for the same job: both call
    `memory_plan.plan_job` and `RolePlan.refusal`. A rollout that cannot fit is a warning: no
    start-up plan refuses it (vLLM measures its own KV-cache room). A job with GPU instance types but
    no config.json reachable here gets a warning that the plan did not run and how to make it. A
    reward model server (spec.reward.model) that cannot fit its GPU is a warning, when its config.json
    is a local directory here."""
    docs, _ = load_documents(text, file)
    table = instance_types.load()
    errors: list[Problem] = []
    warnings: list[Problem] = []
    for doc in docs:
        if not is_grpojob(doc.data):
            continue
        try:
            spec = job.GRPOJob.model_validate(doc.data).spec
        except pydantic.ValidationError:
            continue  # validate_text says why
        if (refusal := _reward_refusal(spec, Path(file).parent, table)) is not None:
            where = ("spec", "reward", "model")
            warnings.append(Problem(file, doc.line(where), dotted(where), refusal))
        source = model_config or memory_plan.find_config(spec.model.path, Path(file).parent)
        try:
            plan = _plan(spec, source, table)
        except _NoPlan as e:
            warnings.append(Problem(file, doc.line(("spec", "model", "path")), "spec.model.path", str(e)))
            continue
        if plan is None:
            continue
        for role, found in ((plan.trainer, errors), (plan.rollout, warnings)):
            refusal = role.refusal()
            if refusal is not None:
                where = ("spec", role.role)
                found.append(Problem(file, doc.line(where), dotted(where), refusal))
    return errors, warnings


class _NoPlan(Exception):
    """The plan of a job with a GPU budget could not be made here; the message says why."""


def _plan(
    spec: GRPOJobSpec, source: Path | None, table: instance_types.InstanceTable
) -> memory_plan.Plan | None:
    """The job's plan; None when no role has a GPU budget to hold it to (CPU pods)."""
    try:
        trainer_gpu = _gpu_bytes(table, spec.trainer.instance_type)
        rollout_gpu = _gpu_bytes(table, spec.rollout.instance_type)
    except instance_types.UnknownInstanceType as e:
        raise _NoPlan(f"no memory plan: {e}") from None
    if trainer_gpu is None and rollout_gpu is None:
        return None
    if source is None:
        raise _NoPlan(
            f"no memory plan: {spec.model.path} is not a local directory with a config.json; pass "
            "--model-config config.json to check that the trainer fits (it refuses a job that cannot "
            "at start)"
        )
    try:
        config = json.loads(source.read_text())
        return memory_plan.plan_job(
            config, spec, trainer_gpu_bytes=trainer_gpu, rollout_gpu_bytes=rollout_gpu
        )
    except (OSError, ValueError, TypeError, KeyError, ArithmeticError) as e:
        raise _NoPlan(f"no memory plan: {e}") from None


def _reward_refusal(spec: GRPOJobSpec, base: Path, table: instance_types.InstanceTable) -> str | None:
    """Why one reward model server cannot fit its GPU; None when it fits or cannot be planned here."""
    model = spec.reward.model
    source = memory_plan.find_config(model.path, base) if model is not None else None
    if model is None or source is None:
        return None
    try:
        gpu = _gpu_bytes(table, model.instance_type)
        config = json.loads(source.read_text())
        return memory_plan.plan_reward(config, spec, gpu_bytes=gpu).refusal()
    except (OSError, ValueError, TypeError, KeyError, ArithmeticError, instance_types.UnknownInstanceType):
        return None  # the render check names a bad instance type; an unreadable config plans nothing


def _gpu_bytes(table: instance_types.InstanceTable, name: str | None) -> int | None:
    return table.get(name).gpu_memory_bytes if name else None


def validate_file(
    path: str | Path,
    old: str | Path | None = None,
    warnings: list[Problem] | None = None,
    model_config: Path | None = None,
    paths: path_checks.Options | None = None,
) -> list[Problem]:
    """validate_text on a file (and its old version); `-` reads standard input. With `warnings`, a
    valid file is also held to the memory plan (`memory_problems`, its errors returned with the
    others) and its escalation and memory warnings are appended to `warnings`. With `paths`, a valid
    file's paths and reward imports are checked from here too (`validation.paths`)."""
    text = sys.stdin.read() if str(path) == "-" else Path(path).read_text(encoding="utf-8")
    old_text = Path(old).read_text(encoding="utf-8") if old is not None else None
    problems = validate_text(text, str(path), old_text, str(old))
    valid = not problems
    if valid:
        problems += render_problems(text, str(path))
        valid = not problems
    if warnings is not None and valid:
        warnings += escalation_warnings(text, str(path))
        errors, memory = memory_problems(text, str(path), model_config)
        problems += errors
        warnings += memory
    if paths is not None and valid:
        errors, unchecked = path_checks.path_problems(text, str(path), paths)
        problems += errors
        if warnings is not None:
            warnings += unchecked
    return problems
