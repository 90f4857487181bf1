#!/usr/bin/env bash
# The local Kubernetes control plane for the e2e ring: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and the kwok controller as plain processes on
# loopback (kwokctl's binary runtime, binaries from hack/build-control-plane.sh), with kwok
# fake nodes shaped like an EKS GPU fleet (hack/fleet.sh). Called by developers, CI and the
# session fixture in tests/e2e/conftest.py.
#
#   hack/cluster.sh up          build binaries if needed, start (or reuse) the cluster, print
#                               `export KUBECONFIG=...` on stdout once every node is Ready
#   hack/cluster.sh down        stop every process it started and delete the cluster's state
#   hack/cluster.sh kubeconfig  print the kubeconfig path
#   hack/cluster.sh stages [harness|kwok-default]
#                               write the kwok Stage set (the cluster's, or kwok's defaults
#                               unchanged) to a file and print its path
#   hack/cluster.sh fail-pod NAMESPACE POD [EXIT_CODE]
#                               mark a pod Failed through its status subresource, as a
#                               kubelet would after its container exited with EXIT_CODE (1)
#
# State (pki, etcd data, logs) lives in $GRPO_KWOK_WORKDIR (default /tmp/grpo-kwok-$UID),
# outside the repo. Concurrent `up` calls are serialised by a lock file there.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=hack/versions.sh
source "$here/versions.sh"
# shellcheck source=hack/fleet.sh
source "$here/fleet.sh"

CLUSTER_NAME="${GRPO_CLUSTER_NAME:-grpo-e2e}"
export KWOK_WORKDIR="${GRPO_KWOK_WORKDIR:-${TMPDIR:-/tmp}/grpo-kwok-$(id -u)}"
export KWOK_KUBECTL_BINARY="$BIN_DIR/kubectl"
CLUSTER_DIR="$KWOK_WORKDIR/clusters/$CLUSTER_NAME"
KUBECONFIG_PATH="$CLUSTER_DIR/kubeconfig.yaml"
READY_TIMEOUT="${GRPO_CLUSTER_READY_TIMEOUT:-180s}"

log() { printf '[cluster] %s\n' "$*" >&2; }
kctl() { "$BIN_DIR/kubectl" --kubeconfig "$KUBECONFIG_PATH" "$@"; }
kwokctl() { "$BIN_DIR/kwokctl" --name "$CLUSTER_NAME" -v WARN "$@"; }

# Appends why the cluster was created or deleted, and by whom, to a log beside the clusters:
# several test sessions share one cluster, so a recreation must be traceable.
event() {
  printf '%s %s pid=%s ppid=%s %s\n' "$(date -u +%FT%TZ)" "$CLUSTER_NAME" "$$" "$PPID" "$*" \
    >>"$KWOK_WORKDIR/events.log"
}

# Every component's process is alive (a dead scheduler or kwok controller would leave pods
# Pending behind a healthy-looking API server).
processes_alive() {
  local pidfile
  for pidfile in "$CLUSTER_DIR"/pids/*.pid; do
    [ -f "$pidfile" ] || return 1
    # A killed component may linger as a zombie, which `kill -0` would count as alive.
    case "$(ps -o stat= -p "$(cat "$pidfile")" 2>/dev/null)" in "" | Z*) return 1 ;; esac
  done
}

# The API server answers /readyz. Retried for about a minute: on a loaded machine a single
# slow answer must not make `up` delete a cluster that other sessions are using.
api_ready() {
  local attempt
  for attempt in 1 2 3 4 5 6; do
    kctl get --raw=/readyz --request-timeout=10s >/dev/null 2>&1 && return 0
    [ "$attempt" = 6 ] || sleep 2
  done
  return 1
}

healthy() {
  [ -f "$KUBECONFIG_PATH" ] && processes_alive && stages_current && api_ready
}

# The Stage set kwok plays: kwok's own defaults (hack/build-control-plane.sh copies them from the
# pinned module) with pod-delete replaced by hack/kwok-pod-delete.yaml ("harness"), or left as
# kwok ships it ("kwok-default", for tests/e2e/test_kwok_stages.py). Custom Stages replace all of
# kwok's defaults, hence the whole set. Prints the file's path.
stages() {
  local which="${1:-harness}" src="$BIN_DIR/kwok-stages" out f
  case "$which" in
    harness) f="$here/kwok-pod-delete.yaml" ;;
    kwok-default) f="$src/pod-delete.yaml" ;;
    *) log "unknown stage set '$which' (harness or kwok-default)"; return 2 ;;
  esac
  [ -f "$src/.complete" ] || { log "no kwok stages in $src; run hack/build-control-plane.sh"; return 1; }
  mkdir -p "$KWOK_WORKDIR"
  out="$KWOK_WORKDIR/stages-$which.yaml"
  for y in node-initialize node-heartbeat-with-lease pod-ready pod-complete; do
    cat "$src/$y.yaml"; printf -- '---\n'
  done >"$out.tmp"
  cat "$f" >>"$out.tmp"
  mv "$out.tmp" "$out"
  echo "$out"
}

stages_digest() { sha256sum "$1" | cut -d' ' -f1; }

# The running cluster's kwok plays this checkout's Stage set: a cluster made by an older
# hack/cluster.sh (kwok's default pod-delete) must be recreated, not reused.
stages_current() {
  [ -f "$CLUSTER_DIR/grpo-stages.sha256" ] \
    && [ "$(cat "$CLUSTER_DIR/grpo-stages.sha256")" = "$(stages_digest "$(stages harness)")" ]
}

create_cluster() {
  local staged
  staged="$(stages harness)"
  log "creating kwok cluster '$CLUSTER_NAME' in $CLUSTER_DIR"
  kwokctl create cluster --config "$here/kwokctl.yaml" --config "$staged" --runtime binary --kubeconfig "" --disable-qps-limits \
    --etcd-binary "$BIN_DIR/etcd" \
    --kube-apiserver-binary "$BIN_DIR/kube-apiserver" \
    --kube-controller-manager-binary "$BIN_DIR/kube-controller-manager" \
    --kube-scheduler-binary "$BIN_DIR/kube-scheduler" \
    --kwok-controller-binary "$BIN_DIR/kwok" \
    --wait "$READY_TIMEOUT" >&2
  stages_digest "$staged" >"$CLUSTER_DIR/grpo-stages.sha256"
}

# Reuses a running cluster; otherwise starts a fresh one. A cluster left half-dead (a crash,
# a reboot) is deleted rather than restarted: `kwokctl start` does not revive killed
# processes reliably, and an e2e cluster holds nothing worth keeping.
ensure_running() {
  healthy && { log "cluster '$CLUSTER_NAME' already running"; return 0; }
  if [ -d "$CLUSTER_DIR" ]; then
    local why="API server not ready"
    processes_alive || why="a component's process is dead"
    stages_current || why="its kwok Stages are not this checkout's (hack/kwok-pod-delete.yaml)"
    log "cluster '$CLUSTER_NAME' exists but is not healthy ($why); recreating it"
    event "delete: $why"
    kwokctl delete cluster >&2 || rm -rf "$CLUSTER_DIR"
  fi
  event "create"
  create_cluster
  healthy || { log "kube-apiserver is not ready; logs: $CLUSTER_DIR/logs"; return 1; }
}

# Node manifests of the whole fleet. Status (allocatable, capacity) is set at creation;
# kwok's node-initialize stage keeps it and adds conditions, addresses and heartbeats.
node_manifests() {
  local i=0 name type zone group l1 l2 l3
  while read -r name type zone group l1 l2 l3; do
    printf -- '---\napiVersion: v1\nkind: Node\nmetadata:\n  name: %s\n' "$name"
    printf '  annotations:\n    kwok.x-k8s.io/node: fake\n  labels:\n    type: kwok\n'
    node_labels "$name" "$type" "$zone" "$group" "$l1" "$l2" "$l3" | sed 's/^\([^=]*\)=\(.*\)$/    \1: "\2"/'
    printf 'spec:\n  providerID: aws:///%s/i-0kwok%011d\n' "$zone" "$i"
    printf '  podCIDR: 10.244.%d.0/24\n  podCIDRs: [10.244.%d.0/24]\n' "$i" "$i"
    if [ -n "$(shape_gpu_product "$type")" ]; then
      printf '  taints:\n  - {key: %s, value: "%s", effect: %s}\n' \
        "$GPU_TAINT_KEY" "$GPU_TAINT_VALUE" "$GPU_TAINT_EFFECT"
    fi
    printf 'status:\n  addresses:\n  - {type: InternalIP, address: 10.0.%d.%d}\n' "$((i / 200))" "$((i % 200 + 10))"
    printf '  - {type: Hostname, address: %s}\n  allocatable:\n' "$name"
    shape_allocatable "$type" | sed 's/^\([^=]*\)=\(.*\)$/    \1: "\2"/'
    printf '  capacity:\n'
    shape_capacity "$type" | sed 's/^\([^=]*\)=\(.*\)$/    \1: "\2"/'
    i=$((i + 1))
  done < <(fleet_nodes)
}

# Names of fleet nodes the cluster lacks, one a line.
missing_nodes() {
  local have
  have="$(kctl get nodes -o name)"
  fleet_nodes | while read -r name _; do
    grep -qx "node/$name" <<<"$have" || echo "$name"
  done
}

# Creates the fleet's nodes that are missing; existing ones are left as they are, so a
# second `up` costs one list call.
ensure_nodes() {
  if [ -n "$(missing_nodes)" ]; then
    log "creating fake nodes"
    node_manifests | kctl create -f - 2>&1 | grep -v 'AlreadyExists' >&2 || true
    local still
    still="$(missing_nodes)"
    [ -z "$still" ] || { log "could not create nodes: $(echo "$still" | tr '\n' ' ')"; return 1; }
  fi
  kctl wait --for=condition=Ready node --all --timeout="$READY_TIMEOUT" >/dev/null
  wait_condition_taints_cleared
}

# Ready is not yet schedulable: the node lifecycle controller lifts the not-ready taint it
# put on every new node a few seconds after Ready, and until then pods stay Pending.
wait_condition_taints_cleared() {
  local deadline=$((SECONDS + ${READY_TIMEOUT%s})) tainted
  while :; do
    tainted="$(kctl get nodes -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.spec.taints[*].key}{"\n"}{end}' \
      | grep 'node.kubernetes.io/' || true)"
    [ -z "$tainted" ] && return 0
    [ "$SECONDS" -lt "$deadline" ] || { log "nodes still tainted after $READY_TIMEOUT: $tainted"; return 1; }
    sleep 1
  done
}

up() {
  local start=$SECONDS
  bash "$here/build-control-plane.sh" all
  mkdir -p "$KWOK_WORKDIR"
  exec 9>"$KWOK_WORKDIR/.lock-$CLUSTER_NAME"
  flock 9
  ensure_running
  ensure_nodes
  flock -u 9
  log "ready in $((SECONDS - start))s: $(kctl get nodes --no-headers | wc -l) nodes"
  echo "export KUBECONFIG=$KUBECONFIG_PATH"
}

down() {
  [ -d "$KWOK_WORKDIR" ] || { log "no cluster '$CLUSTER_NAME' in $KWOK_WORKDIR"; return 0; }
  exec 9>"$KWOK_WORKDIR/.lock-$CLUSTER_NAME"
  flock 9
  if [ -d "$CLUSTER_DIR" ]; then
    event "delete: hack/cluster.sh down"
    kwokctl delete cluster >&2
  else
    log "no cluster '$CLUSTER_NAME' in $KWOK_WORKDIR"
  fi
}

# The same patch as the fail_pod fixture of tests/e2e/conftest.py.
fail_pod() {
  local ns="$1" pod="$2" code="$3" patch
  patch="$(kctl get pod -n "$ns" "$pod" -o json | python3 -c '
import datetime, json, sys
pod, code = json.load(sys.stdin), int(sys.argv[1])
now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
ended = {"terminated": {"exitCode": code, "reason": "Error", "startedAt": now, "finishedAt": now}}
statuses = [{"name": c["name"], "image": c["image"], "ready": False, "restartCount": 0, "state": ended}
            for c in pod["spec"]["containers"]]
conditions = [{"type": t, "status": "False", "reason": "PodFailed", "lastTransitionTime": now}
              for t in ("Ready", "ContainersReady")]
print(json.dumps({"status": {"phase": "Failed", "containerStatuses": statuses, "conditions": conditions}}))
' "$code")"
  kctl patch pod -n "$ns" "$pod" --subresource=status --type=strategic -p "$patch" >&2
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  kubeconfig) echo "$KUBECONFIG_PATH" ;;
  stages) stages "${2:-harness}" ;;
  fail-pod) [ $# -ge 3 ] || { echo "usage: $0 fail-pod NAMESPACE POD [EXIT_CODE]" >&2; exit 2; }; fail_pod "$2" "$3" "${4:-1}" ;;
  *) echo "usage: $0 up|down|kubeconfig|stages [harness|kwok-default]|fail-pod NAMESPACE POD [EXIT_CODE]" >&2; exit 2 ;;
esac
