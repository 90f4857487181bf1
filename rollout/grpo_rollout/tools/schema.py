"""A tool's description for the chat template: an OpenAI-style function schema, from the function itself.

The schema is what HF chat templates take as `tools=[...]` and show the model. It comes from
transformers' `get_json_schema` (type hints + a Google-style docstring with an `Args:` section), the
field's one source, so what we render equals what `apply_chat_template(tools=[fn])` would. This module
only adds errors that name the tool and refuses signatures that JSON arguments cannot call. The sandbox
worker calls it (`grpo_rollout.rewards.child`), so a tool's module is imported only there.
"""

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

# The parameter kinds a call with JSON keyword arguments can fill, fn(**arguments).
CALLABLE_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
HOW_TO = (
    "a tool needs a type hint on every argument and a docstring with a summary and an 'Args:' section "
    "describing each argument (Google style): the chat template shows them to the model"
)


def function_schema(
    fn: Callable[..., Any], *, name: str | None = None, path: str | None = None
) -> dict[str, Any]:
    """{"type": "function", "function": {"name", "description", "parameters"}} for `fn`.

    `name` replaces the function's own name (the name the model calls it by); `path` is how the job
    names the tool, quoted in errors. A ValueError says what is missing.
    """
    from transformers.utils import chat_template_utils as hf  # 0.5 s to import; only where schemas are made

    where = f"tool {path or getattr(fn, '__name__', repr(fn))!r}"
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: no inspectable signature ({e})") from None
    if bad := [p.name for p in params if p.kind not in CALLABLE_BY_NAME and p.name not in ("self", "cls")]:
        raise ValueError(
            f"{where}: arguments {bad} are *args, **kwargs or positional-only; a tool is called "
            "with named JSON arguments, so each must be a plain named parameter"
        )
    try:
        with _no_torch(hf):
            schema = hf.get_json_schema(fn)
    except (hf.DocstringParsingException, hf.TypeHintParsingException) as e:
        raise ValueError(f"{where}: {e}; {HOW_TO}") from None
    if not schema["function"]["description"]:
        raise ValueError(f"{where}: the docstring has no summary line; {HOW_TO}")
    if name is not None:
        schema["function"]["name"] = name
    return schema


@contextmanager
def _no_torch(hf: ModuleType) -> Iterator[None]:
    """Keep get_json_schema from importing torch (it does for every type hint, to map torch.Tensor).

    In the sandbox worker that import costs seconds and hundreds of MiB, and under a small memory
    limit it crashes the worker; a text tool's argument is never a tensor. Where torch is already
    imported, nothing changes.
    """
    if "torch" in sys.modules or not hasattr(hf, "is_torch_available"):
        yield
        return
    available, hf.is_torch_available = hf.is_torch_available, lambda: False
    try:
        yield
    finally:
        hf.is_torch_available = available


def check_schema(schema: Any, path: str) -> dict[str, Any]:
    """A schema the job gives as is (not from a docstring): the shape templates expect, or a ValueError."""
    where = f"tool {path!r}: schema"
    if (
        not isinstance(schema, dict)
        or schema.get("type") != "function"
        or not isinstance(schema.get("function"), dict)
    ):
        raise ValueError(f'{where} must be {{"type": "function", "function": {{...}}}}')
    fn = schema["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}: function.name must be a non-empty string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f'{where}: function.parameters must be a JSON schema with "type": "object"')
    return schema
