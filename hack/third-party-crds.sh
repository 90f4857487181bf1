#!/usr/bin/env bash
# Fetches the CRDs of the third-party kinds the operator, the examples and the chart use
# (Kueue queues and workloads, Karpenter node pools, prometheus-operator monitors and rules)
# into a cache keyed by their versions, and prints that directory. The projects' Go modules
# carry the CRD YAML, so the Go module proxy serves them like any module: no release
# downloads. Idempotent: a cache holding every file returns at once.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=hack/versions.sh
source "$here/versions.sh"

# module version directory-in-module file
WANTED="
sigs.k8s.io/kueue $KUEUE_VERSION config/components/crd/bases kueue.x-k8s.io_resourceflavors.yaml
sigs.k8s.io/kueue $KUEUE_VERSION config/components/crd/bases kueue.x-k8s.io_clusterqueues.yaml
sigs.k8s.io/kueue $KUEUE_VERSION config/components/crd/bases kueue.x-k8s.io_localqueues.yaml
sigs.k8s.io/kueue $KUEUE_VERSION config/components/crd/bases kueue.x-k8s.io_workloads.yaml
sigs.k8s.io/kueue $KUEUE_VERSION config/components/crd/bases kueue.x-k8s.io_workloadpriorityclasses.yaml
github.com/aws/karpenter-provider-aws $KARPENTER_AWS_VERSION pkg/apis/crds karpenter.sh_nodepools.yaml
github.com/aws/karpenter-provider-aws $KARPENTER_AWS_VERSION pkg/apis/crds karpenter.k8s.aws_ec2nodeclasses.yaml
github.com/prometheus-operator/prometheus-operator $PROMETHEUS_OPERATOR_VERSION example/prometheus-operator-crd monitoring.coreos.com_servicemonitors.yaml
github.com/prometheus-operator/prometheus-operator $PROMETHEUS_OPERATOR_VERSION example/prometheus-operator-crd monitoring.coreos.com_prometheusrules.yaml
github.com/prometheus-operator/prometheus-operator $PROMETHEUS_OPERATOR_VERSION example/prometheus-operator-crd monitoring.coreos.com_podmonitors.yaml
"

mkdir -p "$CRD_DIR"
while read -r module version sub file; do
  [ -n "$module" ] && [ ! -f "$CRD_DIR/$file" ] || continue
  printf '[third-party-crds] %s from %s@%s\n' "$file" "$module" "$version" >&2
  dir="$(cd "$CRD_DIR" && GOFLAGS=-mod=mod go mod download -json "$module@$version" \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
  install -m 644 "$dir/$sub/$file" "$CRD_DIR/$file.tmp"
  mv "$CRD_DIR/$file.tmp" "$CRD_DIR/$file"
done <<<"$WANTED"
echo "$CRD_DIR"
