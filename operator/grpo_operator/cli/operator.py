"""`grpo-operator operator`: run the controller against the current kubeconfig.

Runs as a plain process (in a Deployment, or on a laptop, or as a subprocess of the e2e
tests). Watches GRPOJobs in the given namespaces (all when none), serves /metrics and
/healthz, and with --peering joins leader election so only one replica acts at a time.
"""

import argparse
import json
import logging
import random
from concurrent.futures import ThreadPoolExecutor

import kopf
from kubernetes import client, config

from grpo_operator import instance_types
from grpo_operator.controller import handlers, metrics, peering
from grpo_operator.controller.kube import Kube
from grpo_operator.controller.reconcile import Reconciler

LOG_FORMATS = {"json": kopf.LogFormat.JSON, "plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch this namespace (repeatable; default all)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=8080, help="port of /metrics and /healthz (0: off)"
    )
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address of /metrics and /healthz")
    parser.add_argument(
        "--metrics-from",
        type=_peers,
        default=[],
        help="JSON list of NetworkPolicy peers that may scrape each job's rollout /metrics",
    )
    parser.add_argument(
        "--instance-types", help="YAML/JSON instance-type rows merged over the built-in table"
    )
    parser.add_argument(
        "--peering", help="leader election among replicas through this kopf peering (default: standalone)"
    )
    parser.add_argument(
        "--priority", type=int, help="peering priority; the highest live replica leads (default random)"
    )
    parser.add_argument(
        "--resync-seconds", type=float, default=60.0, help="reconcile each job at least this often"
    )
    parser.add_argument(
        "--verify-seconds", type=float, default=300.0, help="read children back to catch drift this often"
    )
    parser.add_argument(
        "--workers", type=int, default=8, help="threads that run reconcile passes (jobs reconciled at once)"
    )
    parser.add_argument(
        "--kueue",
        action="store_true",
        help="queue jobs labelled kueue.x-k8s.io/queue-name through Kueue Workloads (Kueue v0.15+)",
    )
    parser.add_argument(
        "--log-format", choices=sorted(LOG_FORMATS), default="json", help="log lines (json: structured)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs")


def _peers(text: str) -> list[dict]:
    """--metrics-from: a JSON list of NetworkPolicyPeer objects, checked here so a typo fails at
    start-up rather than in every job's NetworkPolicy."""
    try:
        peers = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    keys = {"podSelector", "namespaceSelector", "ipBlock"}
    if not isinstance(peers, list) or not all(isinstance(p, dict) and p and set(p) <= keys for p in peers):
        raise argparse.ArgumentTypeError(
            f"a list of NetworkPolicy peers (objects with keys among {sorted(keys)})"
        )
    return peers


def run(args: argparse.Namespace) -> int:
    kopf.configure(verbose=args.verbose, log_format=LOG_FORMATS[args.log_format])
    logging.getLogger("grpo_operator").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if not args.verbose:  # kopf logs every handler success at INFO: one line per pod event
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    config.load_config()
    api = client.ApiClient()
    table = instance_types.load(args.instance_types)
    reconciler = Reconciler(
        Kube(api), table, verify_seconds=args.verify_seconds, kueue=args.kueue, metrics_from=args.metrics_from
    )
    if args.kueue:
        handlers.watch_workloads()
    runtime = handlers.Runtime(
        reconciler=reconciler,
        resync_seconds=args.resync_seconds,
        executor=ThreadPoolExecutor(args.workers, "reconcile"),
    )
    if args.metrics_port:
        server = metrics.serve(args.metrics_port, args.metrics_host)
        logging.getLogger("grpo_operator").info("metrics on %s:%d", args.metrics_host, server.server_port)
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False  # we post our own Events, one per transition
    settings.peering.standalone = args.peering is None
    if args.peering:
        settings.peering.name = args.peering
        settings.peering.priority = (
            args.priority if args.priority is not None else random.randint(1, 1_000_000)
        )
        peering.ensure(api, clusterwide=not args.namespace, namespaces=args.namespace, name=args.peering)
    kopf.run(
        settings=settings,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=settings.peering.priority,
        memo=kopf.Memo(runtime=runtime),
    )
    return 0
