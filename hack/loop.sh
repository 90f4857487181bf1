#!/usr/bin/env bash
# Runs tests again and again under load, to prove a flake gone (or catch one): a busy loop keeps
# one core at 100 % the whole time, as a parallel CI job or the other pytest worker would.
#
#   hack/loop.sh [-n RUNS] [-j BUSY_LOOPS] TEST_ID... [-- PYTEST_ARGS...]
#
# Each run is a fresh pytest process (module fixtures built anew, as in CI) over the given test
# ids. Prints one line a run and a count at the end; a failed run's output is kept under
# $LOOP_DIR (default /tmp/grpo-loop-$UID) as run-N.log. Exits non-zero when any run failed.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
runs=20 busy=1 tests=() extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    -n) runs="$2"; shift 2 ;;
    -j) busy="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) tests+=("$1"); shift ;;
  esac
done
[ ${#tests[@]} -gt 0 ] || { echo "usage: $0 [-n RUNS] [-j BUSY_LOOPS] TEST_ID... [-- PYTEST_ARGS...]" >&2; exit 2; }
out="${LOOP_DIR:-/tmp/grpo-loop-$(id -u)}"
mkdir -p "$out"
pids=()
for _ in $(seq "$busy"); do
  python3 -c 'while True: pass' &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
failed=0
for i in $(seq "$runs"); do
  start=$SECONDS
  if "$root/.venv/bin/python" -m pytest -q "${tests[@]}" "${extra[@]}" >"$out/run-$i.log" 2>&1; then
    echo "run $i: passed in $((SECONDS - start)) s"
    rm -f "$out/run-$i.log"
  else
    failed=$((failed + 1))
    echo "run $i: FAILED in $((SECONDS - start)) s ($out/run-$i.log)"
  fi
done
echo "$((runs - failed)) of $runs runs passed under $busy busy loop(s): ${tests[*]}"
[ "$failed" -eq 0 ]
