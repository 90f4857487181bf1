"""What a rollout pod checks before it starts vLLM: what its node and image must give the layout
the job resolved, stated as a reason the operator puts in the job's status (`EXIT_CONFIG` and
`<Reason>: <message>` in the termination message) instead of an engine that dies in a loop.

- Any EFA pod: an unlimited RLIMIT_MEMLOCK (`grpo_wire.efa.memlock_problems`): `EFAMisconfigured`.
- A DeepEP all2all backend (rollout.vllm.all2allBackend, as resolved): DeepEP imports the way vLLM's
  processes will import it (`grpo_wire.deepep_import`, in a fresh interpreter like theirs, so this
  process stays free of CUDA libraries vLLM would rather load itself); for deepep_v2 through
  aws-ofi-nccl also NCCL GIN's prerequisites (`grpo_wire.efa.gin_problems`): `EPBackendUnavailable`.

It also tells vLLM's processes which backend was resolved (`engines.vllm_deepep.ENV`), where the
DeepEP plugin reads it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, MutableMapping

from grpo_operator.api.roles import resolve_all2all
from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.api.status import Reason
from grpo_wire import efa

from grpo_rollout.engines import vllm_deepep

FIELD = "rollout.vllm.all2allBackend"
IMPORT_TIMEOUT_S = 120


def import_in_child(api: str) -> str | None:
    """Why `deep_ep.<api>` does not import in a fresh interpreter of this pod, or None."""
    code = (
        "import sys\nfrom grpo_wire.deepep_import import import_deep_ep\n"
        f"api, why = import_deep_ep({api!r})\nprint(why)\nsys.exit(0 if api is not None else 1)\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"importing deep_ep took over {IMPORT_TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    lines = (done.stdout.strip() or done.stderr.strip() or f"exit {done.returncode}").splitlines()
    return lines[-1]


def problems(
    spec: GRPOJobSpec,
    env: MutableMapping[str, str],
    facts: Callable[[], efa.NodeFacts] = efa.probe,
    importer: Callable[[str], str | None] = import_in_child,
) -> tuple[str, str] | None:
    """(reason, message) for the first thing this pod lacks, or None. Sets vllm_deepep.ENV in `env`."""
    backend = resolve_all2all(spec.rollout)
    vllm_deepep.announce(backend, env)
    node = facts() if efa.on_efa(env) else None
    if node is not None and (memlock := efa.memlock_problems(node)):
        return Reason.EFA_MISCONFIGURED, "rollout server: " + "; ".join(memlock)
    if backend not in vllm_deepep.APIS:
        return None
    asked = str(spec.rollout.vllm.all2all_backend)
    what = f"{FIELD} {backend}" + (f" (resolved from {asked})" if asked != backend else "")
    # never a silent slower path: the user picks one (vLLM's own moves every token through every GPU)
    instead = f"; or set {FIELD} allgather_reducescatter to run without DeepEP"
    if (why := importer(vllm_deepep.APIS[backend])) is not None:
        return Reason.EP_BACKEND_UNAVAILABLE, f"{what} cannot run in this pod: {why}{instead}"
    gin = efa.gin_problems(node) if node is not None and env.get("NCCL_GIN_PLUGIN") == "ofi" else []
    if backend == vllm_deepep.V2 and gin:
        lacks = "; ".join(gin)
        return Reason.EP_BACKEND_UNAVAILABLE, f"{what} needs NCCL GIN over EFA, which lacks: {lacks}{instead}"
    return None


def stated(spec: GRPOJobSpec) -> str | None:
    """The termination message (`<Reason>: <message>`) for this pod, or None when it can start."""
    found = problems(spec, os.environ)
    return f"{found[0]}: {found[1]}" if found else None
