"""spec.tracking: where trainer rank 0 logs the run for experiment tracking.

Rank 0 logs the spec as the run's parameters once and every step's report as metrics
(`grpo_trainer.tracking`), to one backend: an MLflow tracking server, TensorBoard event files
or Weights & Biases. Credentials come from a Secret the job names, whose keys the renderer
sets as env on the trainer container (render/pods.py); like `storage.credentialsSecret`, that
is an escalation the chart's admission policy checks against the requester's RBAC.
"""

from enum import StrEnum

from pydantic import ConfigDict, Field

from grpo_operator.api.base import ApiModel, cel, credentials_secret_field


class TrackingBackend(StrEnum):
    MLFLOW = "mlflow"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"


# Keys of `credentialsSecret` each backend reads, as env of the trainer container. MLflow takes a
# token or a user/password pair, so each key may be missing from the Secret; W&B needs its key.
SECRET_KEYS: dict[str, tuple[str, ...]] = {
    TrackingBackend.MLFLOW: ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"),
    TrackingBackend.WANDB: ("WANDB_API_KEY",),
}
OPTIONAL_SECRET_KEYS = frozenset(SECRET_KEYS[TrackingBackend.MLFLOW])


class TrackingSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "self.backend != 'mlflow' || (has(self.uri) && self.uri.matches('^https?://'))",
                "tracking.uri: mlflow needs the tracking server's http(s):// URL",
            ),
            (
                "self.backend != 'tensorboard' || (has(self.uri) && !self.uri.matches('^https?://'))",
                "tracking.uri: tensorboard needs the event files' directory (a path or pvc://<claim>/<path>)",
            ),
            (
                "self.backend != 'tensorboard' || !has(self.credentialsSecret)",
                "tracking.credentialsSecret: tensorboard writes files and reads no credentials",
            ),
        )
    )

    backend: TrackingBackend = Field(
        description="backend: required. mlflow (a tracking server), tensorboard (event files) or wandb "
        "(Weights & Biases)."
    )
    uri: str | None = Field(
        default=None,
        max_length=1024,
        pattern=r"^(https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?(/.*)?|/.*|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?)$",
        description="uri: mlflow: required, the tracking server's http(s):// URL. tensorboard: required, "
        "the directory of the event files, an absolute path or 'pvc://<claim>/<path>' (mounted by the "
        "operator). wandb: optional, the server's http(s):// URL (W&B cloud when unset).",
    )
    experiment: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.\-/ ]+$",
        description="experiment: optional, default the job's name. MLflow experiment, W&B project, or "
        "TensorBoard subfolder; each job is one run in it, named after the job.",
    )
    credentials_secret: str | None = credentials_secret_field(
        ", set as env on the trainer container: mlflow reads MLFLOW_TRACKING_TOKEN or "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (each optional), wandb WANDB_API_KEY"
    )
