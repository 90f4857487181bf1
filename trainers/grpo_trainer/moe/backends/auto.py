"""The `auto` EP backend: the gang's measured choice among the backends that can work here.

How it measures and why it never fails a start-up: `grpo_trainer.moe.autoselect`.
"""

from grpo_trainer.moe.autoselect import auto_dispatcher
from grpo_trainer.moe.dispatch import register_backend

register_backend("auto")(auto_dispatcher)
