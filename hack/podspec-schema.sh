#!/usr/bin/env bash
# Regenerates operator/grpo_operator/api/podspec.schema.json, the core/v1 PodSpec schema that
# the GRPOJob CRD embeds as template.spec, from the Kubernetes OpenAPI v3 document shipped in
# the k8s.io/kubernetes Go module (K8S_VERSION of hack/versions.sh, the control plane's version).
# Run by `make podspec-schema` after a Kubernetes bump, then `make crd`; the output is checked
# in, so the CRD build and the tests need neither Go nor the network.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
# shellcheck source=hack/versions.sh
source "$here/versions.sh"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
dir="$(cd "$work" && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
out="$root/operator/grpo_operator/api/podspec.schema.json"
python3 "$here/podspec_schema.py" "$dir/api/openapi-spec/v3/api__v1_openapi.json" \
  --source "k8s.io/kubernetes@$K8S_VERSION" >"$out.tmp"
mv "$out.tmp" "$out"
echo "$out"
