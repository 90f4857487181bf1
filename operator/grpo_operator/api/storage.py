"""spec.storage: how the job's pods reach its object store and where they cache models.

Nothing here is needed on AWS: S3 access comes from EKS Pod Identity or IRSA on the job's
ServiceAccounts (`trainer.serviceAccountAnnotations`, `rollout.serviceAccountAnnotations`),
with no keys in the spec. `endpointUrl`, `region` and `credentialsSecret` serve other
S3-compatible stores (MinIO, Ceph, on-prem appliances); the renderer turns them into the
AWS_* env every AWS SDK reads (render/pods.py). A credentials Secret is an escalation the
chart's admission policy checks against the requester's RBAC (docs/security.md).
"""

from pydantic import Field

from grpo_operator.api.base import ApiModel, cel, credentials_secret_field

DEFAULT_CACHE_DIR = "/var/cache/grpo"
SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


class StorageSpec(ApiModel):
    cache_dir: str = Field(
        default=DEFAULT_CACHE_DIR,
        min_length=2,
        max_length=256,
        pattern=r"^/[A-Za-z0-9_.\-/]+$",
        description="cacheDir: optional, default /var/cache/grpo, an absolute path of at most 256 "
        "characters. Where trainer and rollout pods cache s3:// models, fetched once per pod: an "
        "emptyDir on the node's local disk (never /dev/shm, which is memory).",
        json_schema_extra=cel(
            (
                "!(self == '/dev/shm' || self.startsWith('/dev/shm/') || self == '/etc/grpo' || "
                "self.startsWith('/etc/grpo/') || self == '/mnt/pvc' || self.startsWith('/mnt/pvc/'))",
                "storage.cacheDir must not be /dev/shm (memory), /etc/grpo (the run contract) or "
                "/mnt/pvc (claim mounts)",
            )
        ),
    )
    cache_size_limit: str | None = Field(
        default=None,
        max_length=16,
        pattern=r"^[0-9]+(Mi|Gi|Ti)$",
        description="cacheSizeLimit: optional, e.g. 200Gi. sizeLimit of the cache emptyDir; the kubelet "
        "evicts a pod that writes more. Unset: bounded by the node's ephemeral storage only.",
    )
    endpoint_url: str | None = Field(
        default=None,
        max_length=512,
        pattern=r"^https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?(/.*)?$",
        description="endpointUrl: optional, http(s)://host[:port]. An S3-compatible store instead of "
        "AWS S3 (AWS_ENDPOINT_URL in the pods). Unset: AWS S3 of the pods' region.",
    )
    region: str | None = Field(
        default=None,
        max_length=32,
        pattern=r"^[a-z0-9\-]+$",
        description="region: optional, e.g. us-west-2. AWS_REGION in the pods; unset on EKS, where "
        "Pod Identity / IRSA set it.",
    )
    credentials_secret: str | None = credentials_secret_field(
        " with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, for stores without Pod Identity / IRSA; "
        "set as env on trainer and rollout containers"
    )
