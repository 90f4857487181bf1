"""Shared building blocks of the GRPOJob API models.

Every model of the API derives from `ApiModel`: camelCase on the wire, snake_case in
Python, unknown fields rejected (the API server prunes them; offline validation must
say so instead of silently dropping a typo). `cel` attaches CEL rules to a model or a
field, so the CRD generator and the offline validator read the very same rule text.
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

CEL_KEY = "x-kubernetes-validations"
# Maxima of integers that reach Python or Kubernetes arithmetic (datetime, seeds, counters):
# generous for any real job, far from where datetime, int64 or a float64 JSON number give out.
MAX_SECONDS = 315_360_000  # 10 years
MAX_SEED = 2**32 - 1  # what every RNG the workloads seed accepts (numpy's is the narrowest)
MAX_COUNT = 2**53 - 1  # counters written to status: exact in every JSON reader (float64)


def credentials_secret_field(what: str) -> Any:
    """An optional Secret-name field (DNS subdomain) whose keys the pods read (as env or files): every
    such field carries the same admission rule (validation/escalation.py), and says so."""
    return Field(
        default=None,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description=f"credentialsSecret: optional. Name of a Secret in the job's namespace{what}. Admission "
        "requires the requester to be allowed to get that Secret (or to hold the grpo.dev 'escalate' "
        "permission).",
    )


def cel(*rules: tuple[str, str] | tuple[str, str, str]) -> dict[str, Any]:
    """Return json_schema_extra carrying CEL rules: (rule, message[, fieldPath])."""
    out = []
    for r in rules:
        item = {"rule": r[0], "message": r[1]}
        if len(r) == 3:
            item["fieldPath"] = r[2]
        out.append(item)
    return {CEL_KEY: out}


def immutable(name: str) -> dict[str, Any]:
    """CEL transition rule that refuses any change to a field once the object exists."""
    return cel(("self == oldSelf", f"{name} is immutable"))


class ApiModel(BaseModel):
    """Base of every GRPOJob API model."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
        use_enum_values=True,
    )

    def wire(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase, unset optionals left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
