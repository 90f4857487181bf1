"""Merge a user's pod template override onto the pod the operator rendered.

Called by `render.pods` for spec.trainer.template / spec.rollout.template (docs/architecture.md).
The user adds what the operator does not set (volumes, sidecars, envFrom, imagePullSecrets,
priorityClassName, annotations...). Where both set a value, the operator's wins, because
GPU/EFA resources, rendezvous env and ports are what make the gang work; every such
conflict is returned as a warning so the job's Event and condition can say so. The labels
NetworkPolicies select on are the operator's alone: a template can neither change nor add them.
"""

from typing import Any

from grpo_operator.render import names

# Lists whose items are merged by a key instead of being appended side by side.
_LIST_KEYS = {"volumeMounts": "mountPath", "ports": "containerPort", "volumeDevices": "devicePath"}
# Lists whose items are one choice each (env value vs valueFrom, volume sources): a clash
# keeps the operator's whole item instead of blending two into an invalid one.
_ATOMIC = {"env", "volumes"}
# Pod labels only the operator sets: the NetworkPolicies trust them (render.children).
PROTECTED_LABELS = frozenset({names.LABEL_JOB, names.LABEL_ROLE, names.LABEL_JOB_UID})


def merge(rendered: Any, override: Any, path: str) -> tuple[Any, list[str]]:
    """(merged value, conflicts). `rendered` wins on conflicting scalars; inputs are not mutated."""
    if override is None:
        return rendered, []
    if rendered is None:
        return override, []
    if isinstance(rendered, dict) and isinstance(override, dict):
        return _merge_dicts(rendered, override, path)
    if isinstance(rendered, list) and isinstance(override, list):
        return _merge_lists(rendered, override, path)
    if rendered == override:
        return rendered, []
    return rendered, [f"{path}: kept the operator's {rendered!r} over the template's {override!r}"]


def _merge_dicts(rendered: dict, override: dict, path: str) -> tuple[dict, list[str]]:
    out = dict(rendered)
    conflicts: list[str] = []
    labels = path.count(".") == 3 and path.endswith(".template.metadata.labels")  # the pod's, not a PVC's
    for key, value in override.items():
        if labels and key in PROTECTED_LABELS:
            if rendered.get(key) != value:
                conflicts.append(
                    f"{path}.{key}: only the operator sets this label (network policies trust it); "
                    f"kept {rendered.get(key)!r} over the template's {value!r}"
                )
            continue
        out[key], found = merge(rendered.get(key), value, f"{path}.{key}")
        conflicts += found
    return out, conflicts


def _item_key(field: str, items: list) -> str | None:
    """The key that identifies items of this list, or None if items are plain values."""
    key = _LIST_KEYS.get(field, "name")
    if items and all(isinstance(i, dict) and key in i for i in items):
        return key
    return None


def _merge_lists(rendered: list, override: list, path: str) -> tuple[list, list[str]]:
    field = path.rsplit(".", 1)[-1]
    key = _item_key(field, rendered + override)
    if key is None:
        return rendered + [item for item in override if item not in rendered], []
    out = list(rendered)
    index = {item[key]: i for i, item in enumerate(out)}
    conflicts: list[str] = []
    for item in override:
        i = index.get(item[key])
        if i is None:
            index[item[key]] = len(out)
            out.append(item)
        elif field in _ATOMIC:
            if out[i] != item:
                conflicts.append(
                    f"{path}[{item[key]}]: kept the operator's {out[i]!r} over the template's {item!r}"
                )
        else:
            out[i], found = merge(out[i], item, f"{path}[{item[key]}]")
            conflicts += found
    return out, conflicts
