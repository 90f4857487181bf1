"""Layer rules of grpo_rollout: what the trainer may import stays light, and rollout imports no trainer.

The trainer imports only `grpo_wire.protocol` and `grpo_wire.client`; both must load without
torch (the client is used from the trainer's asyncio thread, and the protocol by anything). The
rollout package itself may use `grpo_operator.api`, the storage layer `grpo_operator.storage` and
the pure sizing laws of `grpo_operator.memory_plan`, but never the trainer, kopf or the rest of the operator.
"""

import ast
import subprocess
import sys
from pathlib import Path

import grpo_rollout

ROOT = Path(grpo_rollout.__file__).parent
FORBIDDEN = ("grpo_trainer", "kopf", "kubernetes")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            # `from pkg import mod` imports pkg.mod: judge what is really taken
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_rollout_imports_only_the_operator_api_and_storage_and_no_trainer():
    for path in ROOT.rglob("*.py"):
        for name in imported_modules(path):
            assert not name.startswith(FORBIDDEN), f"{path.relative_to(ROOT)} imports {name}"
            if name.startswith("grpo_operator"):
                # the memory plan: pure sizing laws the CPU vLLM engine sizes its KV cache with, the
                # same the operator plans with (one source per fact); part of the shared core
                allowed = ("grpo_operator.api", "grpo_operator.storage", "grpo_operator.memory_plan")
                assert name.startswith(allowed), f"{path.relative_to(ROOT)} imports {name}"


def test_protocol_and_client_load_without_torch():
    code = (
        "import sys, grpo_wire.client, grpo_wire.protocol; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'vllm')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
