#!/usr/bin/env bash
# A real S3-compatible server on loopback for tests and demos: moto's standalone server
# (`moto[server]`, the one s3fs's own test suite runs) as a plain process. Objects live in its
# memory; `down` drops them. The workloads reach it over HTTP through AWS_ENDPOINT_URL.
#
#   hack/s3.sh up      start (or reuse) the server; print `export AWS_ENDPOINT_URL=...
#                      AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_REGION=...` on stdout
#                      (use: eval "$(hack/s3.sh up)")
#   hack/s3.sh down    stop it
#   hack/s3.sh env     print the exports of the running server
#
# State (pid, port, log) lives in $GRPO_S3_WORKDIR (default /tmp/grpo-s3-$UID), outside the
# repo, like hack/cluster.sh's. The port is $GRPO_S3_PORT (default 9000). The test suite starts
# its own server on a free port (tests/conftest.py, fixture s3_server).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
WORKDIR="${GRPO_S3_WORKDIR:-${TMPDIR:-/tmp}/grpo-s3-$(id -u)}"
PORT="${GRPO_S3_PORT:-9000}"
PY="${PYTHON:-$root/.venv/bin/python}"
[ -x "$PY" ] || PY=python3

log() { printf '[s3] %s\n' "$*" >&2; }

alive() { [ -f "$WORKDIR/pid" ] && kill -0 "$(cat "$WORKDIR/pid")" 2>/dev/null; }

print_env() {
  local port
  port="$(cat "$WORKDIR/port")"
  echo "export AWS_ENDPOINT_URL=http://127.0.0.1:$port AWS_ACCESS_KEY_ID=grpo-test" \
    "AWS_SECRET_ACCESS_KEY=grpo-test-secret AWS_REGION=us-west-2"
}

answers() {
  "$PY" - "$1" <<'PY'
import sys, urllib.request, urllib.error
try:
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/", timeout=2)
except urllib.error.HTTPError:
    pass  # any HTTP answer means it serves
except OSError:
    sys.exit(1)
PY
}

up() {
  mkdir -p "$WORKDIR"
  if alive; then
    log "reusing the server on port $(cat "$WORKDIR/port") (pid $(cat "$WORKDIR/pid"))"
    print_env
    return
  fi
  "$PY" -c "import moto.server" 2>/dev/null || {
    log "moto[server] is not installed in $PY; run make setup"
    exit 1
  }
  log "starting moto's S3 server on 127.0.0.1:$PORT (log: $WORKDIR/server.log)"
  setsid "$PY" -m moto.server -H 127.0.0.1 -p "$PORT" >"$WORKDIR/server.log" 2>&1 </dev/null &
  echo $! >"$WORKDIR/pid"
  echo "$PORT" >"$WORKDIR/port"
  for _ in $(seq 1 100); do
    if answers "$PORT"; then
      print_env
      return
    fi
    alive || { log "the server exited:"; cat "$WORKDIR/server.log" >&2; exit 1; }
    sleep 0.2
  done
  log "the server did not answer on port $PORT within 20 s"
  exit 1
}

down() {
  if alive; then
    kill "$(cat "$WORKDIR/pid")"
    log "stopped pid $(cat "$WORKDIR/pid")"
  fi
  rm -f "$WORKDIR/pid" "$WORKDIR/port"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env)
    if alive; then print_env; else
      log "not running"
      exit 1
    fi
    ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
