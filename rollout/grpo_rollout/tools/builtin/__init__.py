"""The built-in tools, one module each, registered in `grpo_rollout.tools.registry.BUILTINS`.

`BUILTINS` imports every module here at its first lookup, so a new built-in is one file here whose
function is decorated `@BUILTINS.register(name)`, plus its test.
"""
