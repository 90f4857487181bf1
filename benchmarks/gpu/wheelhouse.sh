#!/usr/bin/env bash
# The wheelhouse of benchmarks/gpu/run_all.py: what it imports beyond torch (and torch's own
# requirements), as manylinux x86_64 wheels in .whl/, for a lent GPU machine that has torch and no
# network, whatever its Python: one folder for every Python the project runs on (pure and abi3
# wheels once, numpy/pydantic_core/pyyaml/regex once per Python); run_all.py unpacks the ones
# its interpreter loads (benchmarks/gpu/wheels.py). At the versions of hack/requirements.lock (what
# the venv runs), so the CPU test that runs the same sections in a bare environment
# (tests/unit/test_gpu_run_all.py) checks exactly this list.
# Pythons: 3.10 to 3.12 are asked for; one below pyproject.toml's requires-python (3.10 < 3.11:
# StrEnum and datetime.UTC in our API models, and the lock's transformers 5.24.0, numpy 2.4.6,
# httpx2 2.17.0 and regex 2026.12.2 publish nothing for it) is named as not served, not downloaded.
# Our own packages are not a wheel: run_all.py puts the checked-out sources first on the path.
#   bash benchmarks/gpu/wheelhouse.sh [DEST]   # then carry DEST (default .whl) with the run
#   bash benchmarks/gpu/wheelhouse.sh --plan   # what it would download, per Python; nothing fetched
set -euo pipefail
PLAN=0
if [ "${1:-}" = "--plan" ]; then PLAN=1; shift; fi
DEST=${1:-.whl}
PYTHONS=(3.10 3.11 3.12)
CARRY_LIMIT=$((64 * 1048576)) # the device's limit on the tree that travels: wheels and the checkout
WHEELS=(
  annotated-types
  anyio
  h11
  httpcore2
  httpx2
  huggingface-hub
  idna
  numpy
  packaging
  pydantic
  pydantic-core
  pyyaml
  regex
  safetensors
  tokenizers
  tqdm
  transformers
  truststore
  typing-inspection
)
root="$(cd "$(dirname "$0")/../.." && pwd)"
lock="$root/hack/requirements.lock"
floor=$(sed -nE 's/^requires-python *= *">= *([0-9]+\.[0-9]+).*/\1/p' "$root/pyproject.toml")
[ -n "$floor" ] || { echo "no requires-python >=X.Y in $root/pyproject.toml" >&2; exit 1; }
pins=()
for name in "${WHEELS[@]}"; do
  pin=$(grep -iE "^${name//-/[-_]}==" "$lock") || { echo "$name is not in $lock" >&2; exit 1; }
  pins+=("$pin")
done
below_floor() { [ "$(printf '%s\n%s\n' "$1" "$floor" | sort -V | head -1)" != "$floor" ]; }
for py in "${PYTHONS[@]}"; do
  if below_floor "$py"; then
    echo "python $py: not served: below requires-python >=$floor (pyproject.toml)"
    continue
  fi
  echo "python $py: ${pins[*]}"
  [ "$PLAN" = 1 ] && continue
  mkdir -p "$DEST"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --implementation cp --dest "$DEST" "${pins[@]}"
done
[ "$PLAN" = 1 ] && exit 0
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
tree=$(git -C "$root" ls-files -z | (cd "$root" && xargs -0 du -cb) | awk '/\ttotal$/ {s += $1} END {print s + 0}')
echo "wheelhouse $DEST: $(ls "$DEST"/*.whl | wc -l) wheels, $((bytes / 1048576)) MiB; with the checkout" \
  "$(((bytes + tree) / 1048576)) MiB (limit 64 MiB)"
if [ $((bytes + tree)) -gt "$CARRY_LIMIT" ]; then echo "wheelhouse and checkout over 64 MiB" >&2; exit 1; fi
