"""Which rollout servers exist right now: the sources trainer rank 0 follows during a run.

Used by `grpo_trainer.generation.Generator`. Rollout replicas change while a job runs
(`spec.rollout.autoscaling`, `kubectl scale grpo/NAME`, Spot), so the server list is read again
every few seconds from one of two sources behind the `Source` interface:

- `EndpointSliceSource`, in a cluster: the rollout headless Service's EndpointSlices
  (discovery.k8s.io/v1), ready endpoints only, so a server gets work only once its readiness
  probe passes and stops getting it as soon as it terminates. Needs `list` on endpointslices
  (the trainer's Role, rendered by `render/children.py`).
- `ContractFileSource`, everywhere: the run contract file (`rollout.endpoints`), which the
  operator re-renders from the live replica count (a mounted ConfigMap the kubelet refreshes
  in place) and the local runtime rewrites when the job's `spec.rollout.replicas` is edited.

`choose_source` takes the EndpointSlices when running in a cluster with the API reachable and
permitted, the contract file otherwise. `Follower` wraps a source: a failed read keeps the last
known set and is logged once (and once more when reads work again).
"""

import logging
import os
from pathlib import Path
from typing import Any, Protocol

from grpo_operator.api.contract import ENV_CONTRACT, RunContract

log = logging.getLogger(__name__)

POLL_S = 2.0  # how often the Generator reads its source
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class Source(Protocol):
    """A way to read the current set of rollout server base URLs."""

    name: str

    def read(self) -> list[str]:
        """The servers that should get work now; raises on any failure to read them."""
        ...


class ContractFileSource:
    """`rollout.endpoints` of the run contract file, parsed through the same model every pod uses."""

    name = "run contract"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._raw: bytes | None = None
        self._endpoints: list[str] = []

    def read(self) -> list[str]:
        raw = self.path.read_bytes()  # a ConfigMap volume swaps a symlink: always whole files
        if raw != self._raw:
            self._endpoints = list(RunContract.model_validate_json(raw).rollout.endpoints)
            self._raw = raw
        return list(self._endpoints)


class EndpointSliceSource:
    """The ready endpoints of the rollout headless Service, from its EndpointSlices.

    A StatefulSet pod's endpoint carries its hostname; its URL is then the pod's stable DNS name,
    the very URL the contract lists (`http://<pod>.<service>:<port>`), else its address."""

    name = "EndpointSlices"

    def __init__(self, namespace: str, service: str, service_dns: str, port: int, api: Any = None) -> None:
        """`service`: the Service's name; `service_dns`: its DNS name (`<svc>.<ns>.svc`); `api`:
        a kubernetes DiscoveryV1Api, by default one with the pod's in-cluster identity."""
        if api is None:
            from kubernetes import client, config  # only in a cluster: keeps local start-up lean

            config.load_incluster_config()
            api = client.DiscoveryV1Api()
        self._api = api
        self.namespace, self.service, self.service_dns, self.port = namespace, service, service_dns, port

    def read(self) -> list[str]:
        slices = self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"{SERVICE_NAME_LABEL}={self.service}", _request_timeout=10
        )
        urls: set[str] = set()
        for item in slices.items:
            port = next((p.port for p in item.ports or [] if p.port), self.port)
            for ep in item.endpoints or []:
                if not _serving(ep.conditions):
                    continue
                if ep.hostname:
                    urls.add(f"http://{ep.hostname}.{self.service_dns}:{port}")
                elif ep.addresses:
                    host = ep.addresses[0]
                    urls.add(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
        return sorted(urls)


def _serving(conditions: Any) -> bool:
    """Whether an endpoint's pod passes its readiness probe. `serving` is that, even where the Service
    publishes not-ready addresses (the Service of servers spanning nodes, whose workers must resolve
    their leader before it is ready), where `ready` is always true; without `serving` (older API
    servers), `ready`. Unset means ready (the API's convention); terminating pods are neither."""
    if conditions is None:
        return True
    serving = getattr(conditions, "serving", None)
    return (serving if serving is not None else conditions.ready) is not False


class Follower:
    """Reads a source; on failure keeps the last known set and logs once per outage."""

    def __init__(self, source: Source, initial: list[str]) -> None:
        self.source = source
        self.last = list(initial)
        self._failing = False

    def poll(self) -> list[str]:
        try:
            self.last = self.source.read()
        except Exception as e:  # any failure: the last known set is the best guess
            if not self._failing:
                log.warning(
                    "cannot read the rollout servers from the %s (keeping %d known): %s",
                    self.source.name,
                    len(self.last),
                    e,
                )
            self._failing = True
            return list(self.last)
        if self._failing:
            log.info("reading the rollout servers from the %s works again", self.source.name)
        self._failing = False
        return list(self.last)


def choose_source(contract: RunContract, env: dict[str, str] | None = None, api: Any = None) -> Source | None:
    """EndpointSlices in a cluster when they can be listed, else the contract file; None when the
    contract came inline (no file to re-read) and no cluster is reachable."""
    env = dict(os.environ) if env is None else env
    if "KUBERNETES_SERVICE_HOST" in env or api is not None:
        service = contract.rollout.service.split(".", 1)[0]
        try:
            source = EndpointSliceSource(
                contract.namespace, service, contract.rollout.service, contract.rollout.port, api=api
            )
            source.read()
            log.info("following rollout servers through the EndpointSlices of Service %s", service)
            return source
        except Exception as e:  # no client, no RBAC, no API: the contract file still works
            log.warning("cannot list EndpointSlices (%s); following the run contract file instead", e)
    value = env.get(ENV_CONTRACT, "")
    if not value or value.lstrip().startswith("{") or not Path(value).is_file():
        log.warning("the run contract is not a file: the rollout servers are fixed for this run")
        return None
    return ContractFileSource(value)


__all__ = ["POLL_S", "ContractFileSource", "EndpointSliceSource", "Follower", "Source", "choose_source"]
