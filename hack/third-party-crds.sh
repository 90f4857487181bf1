#!/usr/bin/env bash
# Fetches the CRDs of the third-party kinds the examples and the chart create (Kueue queues,
# Karpenter node pools, prometheus-operator monitors and rules) into a cache keyed by their
# versions, and prints that directory. The projects' Go modules carry the CRD YAML, so the Go
# module proxy serves them like any module: no release downloads. Idempotent.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=hack/versions.sh
source "$here/versions.sh"

log() { printf '[third-party-crds %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# Copies FILES from directory SUB of Go module MODULE@VERSION into $work.
fetch() {
  local module="$1" version="$2" sub="$3" dir
  shift 3
  dir="$(cd "$work" && GOFLAGS=-mod=mod go mod download -json "$module@$version" | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
  for f in "$@"; do
    cp "$dir/$sub/$f" "$work/"
  done
}

if [ ! -f "$CRD_DIR/.complete" ]; then
  log "fetching CRDs: Kueue $KUEUE_VERSION, Karpenter AWS $KARPENTER_AWS_VERSION, prometheus-operator $PROMETHEUS_OPERATOR_VERSION"
  mkdir -p "$(dirname "$CRD_DIR")"
  work="$(mktemp -d "$CRD_DIR.XXXX")"
  trap 'rm -rf "$work"' EXIT
  fetch sigs.k8s.io/kueue "$KUEUE_VERSION" config/components/crd/bases \
    kueue.x-k8s.io_resourceflavors.yaml kueue.x-k8s.io_clusterqueues.yaml kueue.x-k8s.io_localqueues.yaml
  fetch github.com/aws/karpenter-provider-aws "$KARPENTER_AWS_VERSION" pkg/apis/crds \
    karpenter.sh_nodepools.yaml karpenter.k8s.aws_ec2nodeclasses.yaml
  fetch github.com/prometheus-operator/prometheus-operator "$PROMETHEUS_OPERATOR_VERSION" example/prometheus-operator-crd \
    monitoring.coreos.com_servicemonitors.yaml monitoring.coreos.com_prometheusrules.yaml
  chmod 644 "$work"/*.yaml
  touch "$work/.complete"
  rm -rf "$CRD_DIR"
  mv "$work" "$CRD_DIR"
  trap - EXIT
fi
echo "$CRD_DIR"
