#!/usr/bin/env bash
# The real LeaderWorkerSet controller (kubernetes-sigs/lws, Go module sigs.k8s.io/lws) for the
# e2e ring: its manager built from the Go module (no Docker, no prebuilt binaries) and run as a
# plain process beside the local control plane of hack/cluster.sh, webhooks included. Called by
# developers, CI (make control-plane builds it) and the lws_controller fixture of
# tests/e2e/conftest.py.
#
#   hack/lws.sh build          build the manager (package sigs.k8s.io/lws/cmd) into
#                              $GRPO_CACHE/bin/lws-$LWS_VERSION with the module's CRD and webhook
#                              manifests beside it; a warm cache returns at once. Cold (empty Go
#                              module and build caches, downloads included): 95 s measured on 2 cores
#   hack/lws.sh up             build if needed; on the running local cluster apply the CRD, start
#                              (or reuse) the manager, register its webhooks, and return once they
#                              answer; prints the manager's log path
#   hack/lws.sh down           stop the manager and delete its webhook configurations (a webhook
#                              with failurePolicy Fail and no server would refuse every LWS)
#   hack/lws.sh crd-only       apply only the CRD (no controller, no webhooks)
#   hack/lws.sh uninstall-crd  `down`, then delete the CRD
#
# The API server runs on loopback, so the webhooks are registered by URL
# (https://127.0.0.1:PORT/<upstream path>) with the caBundle of a CA made here, whose server
# cert (IP SAN 127.0.0.1) the manager serves from its cert dir; the manager's own cert rotation
# (internalCertManagement) is off, as is leader election. Its ports come from 16000-16999: below
# the tests' port blocks (tests/support/ports.py, from 17000) and kwokctl's (from 32767 down).
# State (pid, log, config, certs) lives in $GRPO_KWOK_WORKDIR/lws-$CLUSTER_NAME, beside the
# cluster's own directory, which `kwokctl delete cluster` removes while our process lives on: a
# manager started against another cluster (another kube-system UID) or binary is replaced.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=hack/versions.sh
source "$here/versions.sh"

LWS_DIR="$GRPO_CACHE/bin/lws-$LWS_VERSION"
CLUSTER_NAME="${GRPO_CLUSTER_NAME:-grpo-e2e}"
KWOK_WORKDIR="${GRPO_KWOK_WORKDIR:-${TMPDIR:-/tmp}/grpo-kwok-$(id -u)}"
STATE_DIR="$KWOK_WORKDIR/lws-$CLUSTER_NAME"
PID_FILE="$STATE_DIR/manager.pid"
LOG_FILE="$STATE_DIR/manager.log"
CRD_NAME="leaderworkersets.leaderworkerset.x-k8s.io"
WEBHOOKS="mutatingwebhookconfiguration/lws-mutating-webhook-configuration validatingwebhookconfiguration/lws-validating-webhook-configuration"
READY_TIMEOUT="${GRPO_LWS_READY_TIMEOUT:-120}"
# PyYAML reads the upstream webhook manifests; the venv has it (hack/venv.sh).
PY="${PYTHON:-$here/../.venv/bin/python}"
[ -x "$PY" ] || PY=python3

log() { printf '[lws] %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }
KUBECONFIG_PATH="$(bash "$here/cluster.sh" kubeconfig)"
kctl() { "$BIN_DIR/kubectl" --kubeconfig "$KUBECONFIG_PATH" "$@"; }

build() {
  [ -f "$LWS_DIR/.complete" ] && return 0
  mkdir -p "$GRPO_CACHE/bin"
  exec 9>"$LWS_DIR.lock"
  flock 9
  [ -f "$LWS_DIR/.complete" ] && { exec 9>&-; return 0; }
  local tmp="$LWS_DIR.tmp" src start=$SECONDS
  rm -rf "$tmp"
  mkdir -p "$tmp/crd" "$tmp/webhook"
  log "building the LWS manager $LWS_VERSION from sigs.k8s.io/lws/cmd (cold: about 95 s on 2 cores)"
  src="$(cd "$tmp" && go mod download -json "sigs.k8s.io/lws@$LWS_VERSION" \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')"
  # Built inside the downloaded module, so its own go.mod and go.sum pin every dependency (`go install
  # pkg@version` would also ask the proxy for the module's version list, which a mirror may refuse).
  (cd "$src" && CGO_ENABLED=0 go build -trimpath -buildvcs=false -o "$tmp/lws-manager" \
    -ldflags "-s -w -X sigs.k8s.io/lws/pkg/version.GitVersion=$LWS_VERSION" ./cmd)
  # v0.8.0 keeps its CRD in config/crd/bases and the webhooks in config/webhook (upstream's later
  # layout moves them under config/components/).
  install -m 644 "$src"/config/crd/bases/*.yaml "$tmp/crd/"
  install -m 644 "$src/config/webhook/manifests.yaml" "$src/config/webhook/mutating-patch.yaml" \
    "$src/config/webhook/validating-patch.yaml" "$tmp/webhook/"
  touch "$tmp/.complete"
  rm -rf "$LWS_DIR"
  mv "$tmp" "$LWS_DIR"
  exec 9>&-
  log "built $LWS_DIR in $((SECONDS - start))s"
}

need_cluster() {
  [ -f "$KUBECONFIG_PATH" ] || die "no local cluster ($KUBECONFIG_PATH missing): run hack/cluster.sh up first"
  kctl get --raw=/readyz --request-timeout=10s >/dev/null || die "the local cluster's API server is not ready"
}

# `kubectl wait` errors out on a just-applied CRD that has no conditions yet, hence the poll.
apply_crd() {
  kctl apply --server-side --force-conflicts --field-manager=grpo-lws -f "$LWS_DIR/crd" >/dev/null
  local deadline=$((SECONDS + 60))
  until [ "$(kctl get "crd/$CRD_NAME" -o jsonpath="{.status.conditions[?(@.type=='Established')].status}" 2>/dev/null)" = True ]; do
    [ "$SECONDS" -lt "$deadline" ] || die "CRD $CRD_NAME not Established after 60s"
    sleep 0.5
  done
}

# The pid of a live manager, if any (a zombie or a reused pid of another program is none).
manager_pid() {
  local pid
  [ -f "$PID_FILE" ] || return 1
  pid="$(cat "$PID_FILE")"
  case "$(ps -o stat= -p "$pid" 2>/dev/null)" in "" | Z*) return 1 ;; esac
  [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$(cat "$STATE_DIR/manager.exe" 2>/dev/null)" ] || return 1
  echo "$pid"
}

cluster_uid() { kctl get namespace kube-system -o jsonpath='{.metadata.uid}'; }

# Three loopback ports nobody listens on, from 16000 up.
free_ports() {
  python3 - <<'PY'
import socket
found = []
for port in range(16000, 17000):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    found.append(str(port))
    if len(found) == 3:
        break
print(" ".join(found))
PY
}

# A CA and a server cert for 127.0.0.1 signed by it, made once per state dir.
make_certs() {
  local d="$STATE_DIR/certs"
  [ -f "$d/tls.crt" ] && [ -f "$d/ca.crt" ] && return 0
  mkdir -p "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=grpo-e2e-lws-ca" \
    -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout "$d/tls.key" -out "$d/tls.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n' >"$d/ext.cnf"
  openssl x509 -req -in "$d/tls.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial -days 3650 \
    -extfile "$d/ext.cnf" -out "$d/tls.crt" 2>/dev/null
  rm -f "$d/tls.csr" "$d/ext.cnf"
}

# The manager's Configuration (api/config/v1alpha1 at v0.8.0).
write_config() {
  local webhook_port="$1" metrics_port="$2" health_port="$3"
  cat >"$STATE_DIR/config.yaml" <<EOF
apiVersion: config.lws.x-k8s.io/v1alpha1
kind: Configuration
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
webhook:
  host: 127.0.0.1
  port: $webhook_port
  certDir: $STATE_DIR/certs
metrics:
  bindAddress: 127.0.0.1:$metrics_port
health:
  healthProbeBindAddress: 127.0.0.1:$health_port
EOF
  echo "$webhook_port" >"$STATE_DIR/webhook.port"
}

start_manager() {
  local ports
  read -r -a ports <<<"$(free_ports)"
  [ "${#ports[@]}" = 3 ] || die "no three free loopback ports in 16000-16999"
  make_certs
  write_config "${ports[@]}"
  cluster_uid >"$STATE_DIR/cluster.uid"
  readlink -f "$LWS_DIR/lws-manager" >"$STATE_DIR/manager.exe"
  log "starting the LWS manager $LWS_VERSION (webhook port ${ports[0]}); log: $LOG_FILE"
  # Its own session, so a Ctrl-C of the caller's process group leaves it running; the lock fds
  # are closed so it does not hold them.
  KUBECONFIG="$KUBECONFIG_PATH" setsid "$LWS_DIR/lws-manager" --config "$STATE_DIR/config.yaml" \
    </dev/null >>"$LOG_FILE" 2>&1 8>&- 9>&- &
  echo $! >"$PID_FILE"
}

stop_manager() {
  local pid i
  pid="$(manager_pid)" || { rm -f "$PID_FILE"; return 0; }
  log "stopping the LWS manager (pid $pid)"
  kill "$pid"
  for i in $(seq 50); do
    manager_pid >/dev/null || break
    [ "$i" = 50 ] && kill -9 "$pid"
    sleep 0.2
  done
  rm -f "$PID_FILE"
}

# Upstream's webhook configurations (config/webhook: manifests.yaml with the kustomize patches that
# give the pod webhooks their objectSelector, and config/default's `lws-` name prefix), pointed at
# the manager on loopback.
register_webhooks() {
  "$PY" - "$LWS_DIR/webhook" "$(cat "$STATE_DIR/webhook.port")" "$STATE_DIR/certs/ca.crt" <<'PY' \
    | kctl apply --server-side --force-conflicts --field-manager=grpo-lws -f - >/dev/null
import base64, json, pathlib, sys
import yaml
src, port, ca = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
patches = {"MutatingWebhookConfiguration": "mutating-patch.yaml", "ValidatingWebhookConfiguration": "validating-patch.yaml"}
bundle = base64.b64encode(ca.read_bytes()).decode()
items = []
for doc in yaml.safe_load_all((src / "manifests.yaml").read_text()):
    if not doc:
        continue
    for op in yaml.safe_load((src / patches[doc["kind"]]).read_text()):
        assert op["op"] == "replace" and op["path"].startswith("/webhooks/"), op
        doc["webhooks"][int(op["path"].rsplit("/", 1)[1])] = op["value"]
    doc["metadata"]["name"] = "lws-" + doc["metadata"]["name"]
    for hook in doc["webhooks"]:
        path = hook["clientConfig"]["service"]["path"]
        hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle}
    items.append(doc)
print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
PY
}

# The webhooks answer once a server-side dry-run create of a small LWS passes them.
wait_webhooks() {
  local deadline=$((SECONDS + READY_TIMEOUT)) probe out
  probe='{"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
    "metadata": {"name": "grpo-lws-probe", "namespace": "default"},
    "spec": {"leaderWorkerTemplate": {"size": 2, "workerTemplate": {"spec": {"containers": [
      {"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}}}}'
  until out="$(kctl create --dry-run=server -o name -f - <<<"$probe" 2>&1)"; do
    manager_pid >/dev/null || { tail -n 30 "$LOG_FILE" >&2; die "the LWS manager exited; log: $LOG_FILE"; }
    [ "$SECONDS" -lt "$deadline" ] || { tail -n 30 "$LOG_FILE" >&2; die "webhooks not answering after ${READY_TIMEOUT}s: $out"; }
    sleep 1
  done
}

up() {
  local start=$SECONDS
  build
  need_cluster
  mkdir -p "$STATE_DIR"
  exec 8>"$STATE_DIR.lock"
  flock 8
  apply_crd
  if manager_pid >/dev/null && [ "$(cat "$STATE_DIR/cluster.uid" 2>/dev/null)" = "$(cluster_uid)" ]; then
    log "LWS manager already running (pid $(manager_pid))"
  else
    stop_manager
    start_manager
  fi
  register_webhooks
  wait_webhooks
  flock -u 8
  log "LWS $LWS_VERSION ready in $((SECONDS - start))s"
  echo "$LOG_FILE"
}

down() {
  mkdir -p "$STATE_DIR"
  exec 8>"$STATE_DIR.lock"
  flock 8
  stop_manager
  # shellcheck disable=SC2086 # two names
  [ -f "$KUBECONFIG_PATH" ] && kctl delete --ignore-not-found --wait=false $WEBHOOKS >/dev/null 2>&1 || true
}

crd_only() {
  build
  need_cluster
  apply_crd
  log "CRD $CRD_NAME Established (no controller)"
}

uninstall_crd() {
  down
  need_cluster
  kctl delete --ignore-not-found --timeout=60s "crd/$CRD_NAME" >/dev/null
  log "CRD $CRD_NAME deleted"
}

case "${1:-}" in
  build) build ;;
  up) up ;;
  down) down ;;
  crd-only) crd_only ;;
  uninstall-crd) uninstall_crd ;;
  *) echo "usage: $0 build|up|down|crd-only|uninstall-crd" >&2; exit 2 ;;
esac
