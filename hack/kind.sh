#!/usr/bin/env bash
# The Docker path to an e2e cluster, for machines that have a Docker engine (CI here uses
# hack/cluster.sh instead). Creates a kind cluster whose workers are dressed as nodes of the
# simulated EKS fleet (hack/fleet.sh): EKS/topology labels, the GPU taint, and nvidia.com/gpu
# and vpc.amazonaws.com/efa advertised as extended resources by patching node status, the
# way the Kubernetes docs advertise extended resources without a device plugin.
#
#   hack/kind.sh up          create (or reuse) the cluster, print `export KUBECONFIG=...`
#   hack/kind.sh down        delete the cluster
#   hack/kind.sh kubeconfig  print the kubeconfig path
#
# Then: eval "$(hack/kind.sh up)" && .venv/bin/python -m pytest tests/e2e
#
# Needs docker and kind (https://kind.sigs.k8s.io) on PATH; kubectl comes from the cache of
# hack/build-control-plane.sh when present, else from PATH. Limits of the disguise: cpu,
# memory and hugepages-2Mi stay the real ones of the Docker host (the kubelet rewrites them),
# and pods "using" GPUs run without any device.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=hack/versions.sh
source "$here/versions.sh"
# shellcheck source=hack/fleet.sh
source "$here/fleet.sh"

CLUSTER_NAME="${GRPO_CLUSTER_NAME:-grpo-e2e}"
# Fleet entries given to the kind workers, in order: one worker each.
read -r -a KIND_FLEET <<<"${GRPO_KIND_FLEET:-p5-0 p5-1 p5en-0 cpu-0}"
KUBECONFIG_PATH="${GRPO_KIND_KUBECONFIG:-$GRPO_CACHE/kind-$CLUSTER_NAME.kubeconfig}"
KUBECTL="$BIN_DIR/kubectl"
[ -x "$KUBECTL" ] || KUBECTL="kubectl"

log() { printf '[kind] %s\n' "$*" >&2; }
kctl() { "$KUBECTL" --kubeconfig "$KUBECONFIG_PATH" "$@"; }

require() {
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { log "needs '$tool' on PATH"; exit 1; }
  done
}

create_cluster() {
  local config
  config="$(printf 'kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nnodes:\n- role: control-plane\n')"
  for _ in "${KIND_FLEET[@]}"; do config+=$'\n- role: worker'; done
  log "creating kind cluster '$CLUSTER_NAME' with ${#KIND_FLEET[@]} workers"
  mkdir -p "$(dirname "$KUBECONFIG_PATH")"
  kind create cluster --name "$CLUSTER_NAME" --kubeconfig "$KUBECONFIG_PATH" --wait 180s --config - <<<"$config" >&2
}

# Labels, taint and extended resources of fleet entry $2 onto kind node $1. The kubelet owns
# kubernetes.io/* labels (hostname, arch, os), so those stay as they are.
dress_node() {
  local node="$1" entry="$2" line type zone group l1 l2 l3 labels patch=""
  line="$(fleet_nodes | awk -v n="$entry" '$1 == n')"
  [ -n "$line" ] || { log "GRPO_KIND_FLEET names '$entry', which hack/fleet.sh does not list"; exit 2; }
  read -r _ type zone group l1 l2 l3 <<<"$line"
  mapfile -t labels < <(node_labels "$node" "$type" "$zone" "$group" "$l1" "$l2" "$l3" | grep -v '^kubernetes\.io/')
  kctl label node "$node" --overwrite "${labels[@]}" >/dev/null
  if [ -n "$(shape_gpu_product "$type")" ]; then
    kctl taint node "$node" --overwrite "$GPU_TAINT_KEY=$GPU_TAINT_VALUE:$GPU_TAINT_EFFECT" >/dev/null
  fi
  while IFS='=' read -r res qty; do
    case "$res" in */*) ;; *) continue ;; esac
    for field in capacity allocatable; do
      patch+="${patch:+,}{\"op\":\"add\",\"path\":\"/status/$field/${res//\//~1}\",\"value\":\"$qty\"}"
    done
  done < <(shape_allocatable "$type")
  if [ -n "$patch" ]; then
    kctl patch node "$node" --subresource=status --type=json -p "[$patch]" >/dev/null
  fi
  log "$node dressed as $entry ($type, $zone)"
}

up() {
  require docker kind
  if kind get clusters 2>/dev/null | grep -qx "$CLUSTER_NAME"; then
    log "kind cluster '$CLUSTER_NAME' exists; reusing it"
    kind export kubeconfig --name "$CLUSTER_NAME" --kubeconfig "$KUBECONFIG_PATH" >&2
  else
    create_cluster
  fi
  local workers i
  mapfile -t workers < <(kctl get nodes -l '!node-role.kubernetes.io/control-plane' \
    -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' | sort)
  if [ "${#workers[@]}" -ne "${#KIND_FLEET[@]}" ]; then
    log "cluster has ${#workers[@]} workers, GRPO_KIND_FLEET wants ${#KIND_FLEET[@]}; run '$0 down' first"
    exit 1
  fi
  for i in "${!workers[@]}"; do dress_node "${workers[$i]}" "${KIND_FLEET[$i]}"; done
  kctl wait --for=condition=Ready node --all --timeout=180s >/dev/null
  echo "export KUBECONFIG=$KUBECONFIG_PATH"
}

case "${1:-}" in
  up) up ;;
  down) require kind; kind delete cluster --name "$CLUSTER_NAME" >&2; rm -f "$KUBECONFIG_PATH" ;;
  kubeconfig) echo "$KUBECONFIG_PATH" ;;
  *) echo "usage: $0 up|down|kubeconfig" >&2; exit 2 ;;
esac
