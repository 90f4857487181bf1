"""`grpo-operator render JOB.yaml`: print the children the operator would create, offline.

For reviewing a job before applying it, for GitOps diffs, and for debugging placement:
the output is exactly what the controller server-side-applies (plus the per-job token
Secret, which is created once with a random value and so is not printed).
"""

import argparse
import json
import sys
import uuid
from pathlib import Path

import yaml
from pydantic import ValidationError

from grpo_operator import instance_types, render
from grpo_operator.api.job import GRPOJob


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", type=Path, help="GRPOJob manifests (YAML, multi-document ok)")
    parser.add_argument("-n", "--namespace", help="namespace when the manifest has none (default: default)")
    parser.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    parser.add_argument("--instance-types", help="YAML/JSON file of instance-type rows merged over the table")
    parser.add_argument("--contract", action="store_true", help="print only the run contract (job.json)")


def run(args: argparse.Namespace) -> int:
    table = instance_types.load(args.instance_types)
    docs: list[dict] = []
    failed = False
    for path in args.files:
        for raw in yaml.safe_load_all(path.read_text()):
            if not raw:
                continue
            try:
                docs += _render_one(raw, args, table)
            except (ValidationError, render.RenderError) as e:
                meta = raw.get("metadata") or {}
                print(f"{path}: {meta.get('name', '?')}: {e}", file=sys.stderr)
                failed = True
    if args.output == "json":
        print(json.dumps(docs if len(docs) != 1 else docs[0], indent=2))
    else:
        print(yaml.safe_dump_all(docs, sort_keys=False), end="")
    return 1 if failed else 0


def _render_one(raw: dict, args: argparse.Namespace, table: instance_types.InstanceTable) -> list[dict]:
    job = GRPOJob.model_validate(raw)
    meta = job.metadata
    name = meta.get("name")
    if not name:
        raise render.RenderError("metadata.name is required")
    namespace = meta.get("namespace") or args.namespace or "default"
    uid = meta.get("uid") or str(uuid.uuid5(uuid.NAMESPACE_URL, f"grpo.dev/{namespace}/{name}"))
    out = render.render(
        job,
        name=name,
        namespace=namespace,
        uid=uid,
        generation=meta.get("generation", 1),
        instance_types=table,
    )
    for warning in out.warnings:
        print(f"warning: {namespace}/{name}: {warning}", file=sys.stderr)
    if args.contract:
        return [out.contract.model_dump(by_alias=True, exclude_none=True, mode="json")]
    return out.children
