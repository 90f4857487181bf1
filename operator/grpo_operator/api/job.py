"""The GRPOJob resource itself: group/version/kind names and the top-level model."""

from typing import Any, Literal

from pydantic import Field

from grpo_operator.api.base import ApiModel
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


class GRPOJob(ApiModel):
    """GRPOJob: one reinforcement-learning post-training run of a (MoE) language model."""

    api_version: Literal["grpo.dev/v1alpha1"] = Field(default=API_VERSION, description="apiVersion: grpo.dev/v1alpha1.")
    kind: Literal["GRPOJob"] = Field(default=KIND, description="kind: GRPOJob.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="metadata: standard object metadata.")
    spec: GRPOJobSpec = Field(description="spec: required. What to train, on what, and how.")
    status: GRPOJobStatus | None = Field(default=None, description="status: written by the operator and rank 0.")
