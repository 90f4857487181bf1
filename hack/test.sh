#!/usr/bin/env bash
# `make test`'s rings in two pytest runs side by side: the e2e ring and the tests marked `waits`
# (they mostly wait, on the API server or on PyPI) beside the unit + integration rings, which
# run on two pytest-xdist workers, a test file to a worker (its module fixtures built once):
# their tests wait on the processes they start about half the time, so one core would idle.
# Each run goes to its end; the waiting side's output is printed whole after the other's, and
# the run fails if either fails. Extra arguments go to both.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="$root/.venv/bin/python"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
start=$SECONDS
# Its own block of loopback ports (tests/support/ports.py), so no two processes pick alike.
GRPO_TEST_PORT_BLOCK=5 "$py" -m pytest tests/e2e tests/integration -m "e2e or waits" "$@" >"$out/e2e.log" 2>&1 &
e2e=$!
"$py" -m pytest tests/unit tests/integration -m "not waits" -n "${GRPO_TEST_WORKERS:-2}" --dist loadfile "$@"
rest=$?
wait "$e2e"
e2e_rc=$?
echo "======================= e2e ring and the waiting tests ======================="
cat "$out/e2e.log"
echo "unit + integration: exit $rest; e2e: exit $e2e_rc; $((SECONDS - start)) s in all"
[ "$rest" -eq 0 ] && [ "$e2e_rc" -eq 0 ]
