"""`pvc://claim/path` URIs → pod volumes, mounts and in-pod paths.

The renderer mounts each claim a role needs once, at /mnt/pvc/<claim>, and the run contract
carries the in-pod path, so workloads never parse `pvc://`. `s3://` URIs and plain paths are
left to the workload (S3 access comes from IRSA / Pod Identity on the ServiceAccount).
"""

from grpo_operator.render import names

PVC_SCHEME = "pvc://"


def parse_pvc(uri: str) -> tuple[str, str] | None:
    """(claim, path inside the claim) of a `pvc://` URI, None for any other URI."""
    if not uri.startswith(PVC_SCHEME):
        return None
    claim, _, rest = uri[len(PVC_SCHEME) :].partition("/")
    return claim, rest.strip("/")


def volume_name(claim: str) -> str:
    return f"pvc-{claim}"[:63].rstrip("-")


def resolve(uri: str) -> str:
    """The path a pod sees for `uri`: pvc URIs become mount paths, others stay as they are."""
    parsed = parse_pvc(uri)
    if parsed is None:
        return uri
    claim, path = parsed
    base = f"{names.PVC_MOUNT_ROOT}/{claim}"
    return f"{base}/{path}" if path else base


def volumes_and_mounts(uris: list[str | None]) -> tuple[list[dict], list[dict]]:
    """One volume and one mount per distinct claim among `uris`, in first-seen order."""
    claims: list[str] = []
    for uri in uris:
        parsed = parse_pvc(uri) if uri else None
        if parsed and parsed[0] not in claims:
            claims.append(parsed[0])
    volumes = [{"name": volume_name(c), "persistentVolumeClaim": {"claimName": c}} for c in claims]
    mounts = [{"name": volume_name(c), "mountPath": f"{names.PVC_MOUNT_ROOT}/{c}"} for c in claims]
    return volumes, mounts
