#!/usr/bin/env bash
# Creates (once) the project's Python environment in a cache outside the repo, keyed by the
# dependency lists in pyproject.toml and the exact versions in hack/requirements.lock (every
# install runs under it: the same versions on every machine, whatever PyPI published since), links
# it as .venv and installs this checkout into it (editable). A warm cache costs seconds; a cold one
# downloads torch (~4 min).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/hack/versions.sh"
py="${PYTHON:-python3}"
lock="$root/hack/requirements.lock"
key="$("$py" - "$root/pyproject.toml" "$lock" <<'PY'
import hashlib, json, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
pins = open(sys.argv[2]).read()
blob = json.dumps([sys.version_info[:2], p["dependencies"], p["optional-dependencies"], pins], sort_keys=True)
print(hashlib.sha256(blob.encode()).hexdigest()[:12])
PY
)"
venv="$GRPO_CACHE/venv-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "[venv] creating $venv (cold: downloads torch and friends)" >&2
  rm -rf "$venv"; mkdir -p "$GRPO_CACHE"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # torch first: deepspeed's setup imports it.
  "$venv/bin/pip" install -q -c "$lock" "$("$py" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
print(next(d for d in tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["trainer"] if d.startswith("torch")))
PY
)"
  DS_BUILD_OPS=0 "$venv/bin/pip" install -q -c "$lock" -e "${root}[trainer,storage,dev]"
  touch "$venv/.complete"
fi
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$root" >/dev/null
ln -sfn "$venv" "$root/.venv"
# DeepSpeed's CPU Adam (trainer.optimizerOffload: cpu) is JIT-built on first use with ninja (a
# dependency of deepspeed) and a C++ compiler, which pip cannot provide.
command -v c++ >/dev/null || echo "[venv] no C++ compiler (c++): optimizerOffload cpu cannot build DeepSpeed's CPU Adam; install g++" >&2
echo "$venv"
