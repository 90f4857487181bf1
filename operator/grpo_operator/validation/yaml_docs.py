"""Manifests read the way kubectl reads them, with the line of every field kept for messages.

Used by `grpo_operator.validation.check` (and the tests that compare its verdicts with a real
API server's): YAML to JSON as kubectl converts it (timestamps stay strings, 1e-6 is a number,
2.0 an integer), one `Document` per YAML document, and a `Problem` that names file and line.
"""

import base64
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    """One reason a manifest is invalid, printed as `FILE:LINE: field.path: message`."""

    file: str
    line: int
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.path}: {self.message}"


@dataclass
class Document:
    """One YAML document: its JSON value and the line of every node, by path."""

    data: Any
    start: int
    lines: dict[Path_, int] = field(default_factory=dict)

    def line(self, path: Path_) -> int:
        """Line of the deepest existing node on `path` (a defaulted field has no line of its own)."""
        for end in range(len(path), -1, -1):
            if path[:end] in self.lines:
                return self.lines[path[:end]]
        return self.start


class _Loader(yaml.SafeLoader):
    """YAML as kubectl reads it: timestamps stay strings, and 1e-6 is a float (sigs.k8s.io/yaml)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# kubectl's YAML reads 1e-6 as a number; PyYAML's YAML 1.1 floats need a dot and read a string.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def json_value(value: Any) -> Any:
    """A copy as the API server reads JSON: string keys, and 2.0 is an integer (it passes `type: integer`)."""
    if isinstance(value, dict):
        return {(str(k).lower() if isinstance(k, bool) else str(k)): json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_value(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bytes):  # !!binary: JSON carries bytes as base64
        return base64.b64encode(value).decode()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)  # an explicit !!timestamp and the like: a string on the wire


def _index(node: yaml.Node, path: Path_, lines: dict[Path_, int]) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            lines[(*path, str(key.value))] = key.start_mark.line + 1
            _index(value, (*path, str(key.value)), lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index(item, (*path, i), lines)


def load_documents(text: str, file: str) -> tuple[list[Document], list[Problem]]:
    """Parse multi-document YAML; a syntax error becomes one Problem with its line."""
    docs: list[Document] = []
    try:
        loader = _Loader(text)
    except yaml.YAMLError as err:  # a character YAML does not allow (ReaderError)
        line = text[: getattr(err, "position", 0)].count("\n") + 1
        return docs, [Problem(file, line, "<yaml>", f"invalid YAML: {str(err).splitlines()[0]}")]
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            doc = Document(json_value(loader.construct_document(node)), node.start_mark.line + 1)
            _index(node, (), doc.lines)
            docs.append(doc)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        line = mark.line + 1 if mark else 1
        return docs, [Problem(file, line, "<yaml>", f"invalid YAML: {getattr(err, 'problem', None) or err}")]
    finally:
        loader.dispose()
    return [d for d in docs if d.data is not None], []


def dotted(path: Path_) -> str:
    """A path as the API server prints it: spec.trainer.tolerations[0].key, requests.nvidia.com/gpu."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "<root>"
