"""`grpo-operator validate --check-paths`: every path and import path of a job, checked from here.

Paths are read as the local runtime reads them (`grpo_operator.local.plan`): relative to the
manifest's folder, `pvc://CLAIM/...` in the folder `--pvc CLAIM=DIR` stands in for, `s3://` with
this environment's AWS credentials (and the job's `storage.endpointUrl`/`region`). Each is judged
by the rule the trainer applies in the pod (`grpo_operator.storage.check`), so a path that fails
here fails the job there with the same words. Reward functions are imported in a child
interpreter (user code runs there, not in this process); one whose module is not importable here is
a warning that it was not checked, as it may live only in the rollout image. What cannot be judged
from here (a pvc:// without --pvc, the credentials of `storage.credentialsSecret`) is a warning.
"""

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic

from grpo_operator import storage
from grpo_operator.api import job
from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.render.storage import parse_pvc
from grpo_operator.storage.check import Expect, PathError, check
from grpo_operator.validation.yaml_docs import Document, Path_, Problem, dotted, load_documents

IMPORT_TIMEOUT_S = 60.0
# Run in a child: find the module without importing it, then import it and look up the callable.
_IMPORT_CHECK = """
import importlib, importlib.util, json, sys
module, _, attr = sys.argv[1].partition(":")
try:
    found = importlib.util.find_spec(module) is not None
except (ImportError, ValueError):
    found = False
if not found:
    print(json.dumps({"absent": True}))
    sys.exit(0)
try:
    fn = getattr(importlib.import_module(module), attr, None)
except BaseException as e:
    print(json.dumps({"error": f"importing module {module!r} raised {type(e).__name__}: {e}"}))
    sys.exit(0)
print(json.dumps({} if callable(fn) else {"error": f"module {module!r} has no callable {attr!r}"}))
"""


@dataclass(frozen=True)
class Options:
    """How to reach the job's paths from here: `--pvc CLAIM=DIR` folders and the environment."""

    pvc: Mapping[str, Path] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


def path_fields(spec: GRPOJobSpec) -> list[tuple[Path_, str, Expect]]:
    """(field path, value, what it must hold) of every path the job names."""
    out: list[tuple[Path_, str, Expect]] = [(("spec", "model", "path"), spec.model.path, Expect.MODEL)]
    if spec.model.reference_path:
        out.append((("spec", "model", "referencePath"), spec.model.reference_path, Expect.MODEL))
    out.append((("spec", "dataset", "path"), spec.dataset.path, Expect.DATASET))
    if spec.dataset.eval is not None:
        out.append((("spec", "dataset", "eval", "path"), spec.dataset.eval.path, Expect.DATASET))
    out.append((("spec", "checkpoint", "path"), spec.checkpoint.path, Expect.CHECKPOINT_ROOT))
    if spec.checkpoint.resume_from:
        out.append((("spec", "checkpoint", "resumeFrom"), spec.checkpoint.resume_from, Expect.SAVES))
    return out


def s3_env(spec: GRPOJobSpec, env: Mapping[str, str]) -> dict[str, str]:
    """The environment the pods reach S3 with, as far as the spec sets it (render/pods.py)."""
    out = dict(env)
    if spec.storage.endpoint_url:
        out.pop("AWS_ENDPOINT_URL_S3", None)
        out["AWS_ENDPOINT_URL"] = spec.storage.endpoint_url
    if spec.storage.region:
        out["AWS_REGION"] = spec.storage.region
    return out


class _NotHere(Exception):
    """A path that cannot be checked from here; the message says why and how to make it checkable."""


def resolve(value: str, base: Path, pvc: Mapping[str, Path]) -> str:
    """Where `value` is read from here: s3:// as it is, pvc:// in its --pvc folder, else from `base`."""
    kind = storage.scheme(value)
    if kind == "s3":
        return value
    if kind == "pvc":
        claim, rest = parse_pvc(value) or ("", "")
        if claim not in pvc:
            raise _NotHere(f"{value}: not checked: pass --pvc {claim}=DIR to check claim {claim!r} here")
        return str(pvc[claim].resolve() / rest)
    return str((base / value).resolve())


def job_problems(
    spec: GRPOJobSpec, base: Path, options: Options
) -> tuple[list[tuple[Path_, str]], list[tuple[Path_, str]]]:
    """(errors, warnings) as (field path, message) for one job's paths and reward imports."""
    errors: list[tuple[Path_, str]] = []
    warnings: list[tuple[Path_, str]] = []
    env = s3_env(spec, options.env)
    remote = False
    for where, value, expect in path_fields(spec):
        try:
            here = resolve(value, base, options.pvc)
        except _NotHere as e:
            warnings.append((where, str(e)))
            continue
        remote |= storage.is_remote(here)
        try:
            check(dotted(where), here, expect, env=env, credentials="this environment's AWS credentials")
        except PathError as e:
            read_as = f" (read as {here})" if here != value else ""
            errors.append((where, f"{value}{read_as}: {e.why}"))
        except storage.StorageError as e:
            errors.append((where, str(e)))
    if remote and spec.storage.credentials_secret:
        why = "s3:// paths were checked with this environment's AWS credentials, not the Secret's"
        warnings.append((("spec", "storage", "credentialsSecret"), f"not checked offline: {why}"))
    for i, entry in enumerate(spec.reward.functions):
        if entry.function:
            where = ("spec", "reward", "functions", i, "function")
            verdict = import_verdict(entry.function)
            if verdict is not None:
                (errors if verdict[0] else warnings).append((where, verdict[1]))
    return errors, warnings


def import_verdict(target: str, timeout: float = IMPORT_TIMEOUT_S) -> tuple[bool, str] | None:
    """None when `module:function` imports here and is callable; else (is an error, message)."""
    try:
        done = subprocess.run(
            [sys.executable, "-P", "-c", _IMPORT_CHECK, target],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return True, f"{target}: importing it did not finish in {timeout:g} s"
    except (ValueError, IndexError):
        return True, f"{target}: the import check failed: {done.stderr.strip()[-500:]}"
    if answer.get("absent"):
        module = target.partition(":")[0]
        return (
            False,
            f"{target}: not checked offline: module {module!r} is not importable here "
            "(the rollout image must provide it)",
        )
    if "error" in answer:
        return True, f"{target}: {answer['error']}"
    return None


def path_problems(text: str, file: str, options: Options) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings) of every GRPOJob in `text`; paths relative to `file`'s folder."""
    docs, _ = load_documents(text, file)
    errors: list[Problem] = []
    warnings: list[Problem] = []
    base = Path(file).parent.resolve() if file != "-" else Path.cwd()
    for doc in docs:
        spec = _spec(doc)
        if spec is None:
            continue
        found, warned = job_problems(spec, base, options)
        errors += [Problem(file, doc.line(p), dotted(p), m) for p, m in found]
        warnings += [Problem(file, doc.line(p), dotted(p), m) for p, m in warned]
    return errors, warnings


def _spec(doc: Document) -> GRPOJobSpec | None:
    data = doc.data
    if not isinstance(data, dict) or data.get("kind") != job.KIND:
        return None
    try:
        return job.GRPOJob.model_validate(data).spec
    except pydantic.ValidationError:
        return None  # validate_text says why
