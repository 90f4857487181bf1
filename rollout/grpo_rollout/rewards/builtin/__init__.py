"""The built-in reward functions, one module each, registered in `grpo_rollout.rewards.base.BUILTINS`.

`BUILTINS` imports every module here at its first lookup, so a new built-in is one file here whose
function is decorated `@BUILTINS.register(name)`, its test, and its name in the API enum
`BuiltinReward` (operator/grpo_operator/api/spec.py; `tests/unit/test_mirrors.py` pins the two).
"""
