"""The EP backends, one file each: a class (or factory) decorated `@register_backend(name, requires=...)`.

`grpo_trainer.moe.dispatch.BACKENDS` imports every module here at its first lookup, so a new backend
is one new file plus its test (and, for users to name it, its value in `EPBackend`,
`api/roles.py`; `tests/unit/test_mirrors.py` holds the two together). A backend that needs an
optional library registers whether or not it imports, and says why it cannot serve
(`deepep_v1.py`, `deepep_v2.py`). Nothing outside this package imports these modules.
"""
