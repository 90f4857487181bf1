"""Pure rendering: a GRPOJob spec → its run contract and child manifests. No I/O, no kopf.

Callers: the controller (every reconcile), `grpo-operator render`, and the local runtime
(`contract(..., local_ports=...)` plus the StatefulSets' pod templates for the commands).
"""

from grpo_operator.render.children import Rendered, children, render, token_secret, validate
from grpo_operator.render.contract import LocalPorts, RenderError, contract
from grpo_operator.render.pods import COMMANDS, Hardware, hardware

__all__ = [
    "COMMANDS",
    "Hardware",
    "LocalPorts",
    "RenderError",
    "Rendered",
    "children",
    "contract",
    "hardware",
    "render",
    "token_secret",
    "validate",
]
