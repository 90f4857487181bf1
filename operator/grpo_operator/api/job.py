"""The GRPOJob resource itself: group/version/kind names and the top-level model."""

from typing import Any, Literal

from pydantic import ConfigDict, Field

from grpo_operator.api.base import ApiModel, cel
from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.api.status import GRPOJobStatus

GROUP = "grpo.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "GRPOJob"
PLURAL = "grpojobs"
SINGULAR = "grpojob"
SHORT_NAMES = ("grpo",)
CATEGORIES = ("all", "ml")
# The RBAC verb on grpojobs that lets a requester ask for pods beyond what GRPOJob `create` grants
# (docs/security.md); the chart's admission policy checks it, and its ClusterRole grants it.
ESCALATE_VERB = "escalate"
# A job carrying this annotation with the value "true" was approved by a holder of ESCALATE_VERB
# (the admission policy refuses it from anyone else); only then does the operator render escalations.
ESCALATION_APPROVED_ANNOTATION = f"{GROUP}/escalation-approved"
# Child names are '<job>-trainer' / '<job>-rollout': Services need DNS-1035 labels, and a StatefulSet
# name must leave room for its pods' 11-character controller-revision-hash suffix within 63.
MAX_NAME_LENGTH = 44
NAME_RULE = (
    f"!has(self.metadata.name) || (size(self.metadata.name) <= {MAX_NAME_LENGTH} && "
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$'))"
)


class GRPOJob(ApiModel):
    """GRPOJob: one reinforcement-learning post-training run of a (MoE) language model."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                NAME_RULE,
                f"metadata.name must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters "
                "(it prefixes the names of Services and StatefulSets)",
            ),
        )
    )

    api_version: Literal["grpo.dev/v1alpha1"] = Field(
        default=API_VERSION, description="apiVersion: grpo.dev/v1alpha1."
    )
    kind: Literal["GRPOJob"] = Field(default=KIND, description="kind: GRPOJob.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="metadata: standard object metadata.")
    spec: GRPOJobSpec = Field(description="spec: required. What to train, on what, and how.")
    status: GRPOJobStatus | None = Field(
        default=None, description="status: written by the operator and rank 0."
    )
