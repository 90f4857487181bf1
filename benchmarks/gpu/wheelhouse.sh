#!/usr/bin/env bash
# The wheelhouse of benchmarks/gpu/run_all.py: what it imports beyond torch (and torch's own
# requirements), as cp312 manylinux x86_64 wheels in .whl/, for a lent GPU machine that has torch
# and no network. At the versions of hack/requirements.lock (what the venv runs), so the CPU test
# that runs the same sections in a bare environment (tests/unit/test_gpu_run_all.py) checks exactly
# this list.
# Our own packages are not a wheel: run_all.py puts the checked-out sources first on the path.
#   bash benchmarks/gpu/wheelhouse.sh [DEST]   # then carry DEST (default .whl) with the run
set -euo pipefail
DEST=${1:-.whl}
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
lock="$(dirname "$0")/../../hack/requirements.lock"
pins=()
for name in "${WHEELS[@]}"; do
  pin=$(grep -iE "^${name//-/[-_]}==" "$lock") || { echo "$name is not in $lock" >&2; exit 1; }
  pins+=("$pin")
done
mkdir -p "$DEST"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --implementation cp --dest "$DEST" "${pins[@]}"
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "wheelhouse $DEST: $(ls "$DEST"/*.whl | wc -l) wheels, $((bytes / 1048576)) MiB (limit 64 MiB)"
if [ "$bytes" -gt $((64 * 1048576)) ]; then echo "wheelhouse over 64 MiB" >&2; exit 1; fi
