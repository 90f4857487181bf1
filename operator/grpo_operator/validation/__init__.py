"""Offline validation of GRPOJob manifests that reaches the API server's verdicts.

`check` runs the API server's steps in order over the pieces: `yaml_docs` (kubectl's YAML,
lines kept), `schema` (defaulting, pruning, the strict schema, ObjectMeta) and `cel` (the
CRD's rules). This package's names are the ones callers use.
"""

from grpo_operator.validation.cel import cel_problems, evaluate_rule
from grpo_operator.validation.check import check_object, is_grpojob, validate_file, validate_text
from grpo_operator.validation.schema import apply_defaults
from grpo_operator.validation.yaml_docs import Document, Problem, dotted, load_documents

__all__ = [
    "Document",
    "Problem",
    "apply_defaults",
    "cel_problems",
    "check_object",
    "dotted",
    "evaluate_rule",
    "is_grpojob",
    "load_documents",
    "validate_file",
    "validate_text",
]
