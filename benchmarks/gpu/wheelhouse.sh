#!/usr/bin/env bash
# The wheelhouse of benchmarks/gpu/run_all.py: what it imports beyond torch (and torch's own
# requirements), as cp312 manylinux x86_64 wheels in .whl/, for a lent GPU machine that has torch
# and no network. Pinned to the versions this checkout's venv runs, so the CPU test that runs the
# same sections in a bare environment (tests/unit/test_gpu_run_all.py) checks exactly this list.
# Our own packages are not a wheel: run_all.py puts the checked-out sources first on the path.
#   bash benchmarks/gpu/wheelhouse.sh [DEST]   # then carry DEST (default .whl) with the run
set -euo pipefail
DEST=${1:-.whl}
WHEELS=(
  annotated-types==0.8.0
  anyio==4.16.0
  h11==0.16.0
  httpcore2==2.16.2
  httpx2==2.16.2
  huggingface-hub==2.3.0
  idna==3.20
  numpy==2.4.6
  packaging==26.4
  pydantic==2.14.4
  pydantic-core==2.50.5
  pyyaml==6.0.4
  regex==2026.11.19
  safetensors==0.8.0
  tokenizers==0.23.3
  tqdm==4.70.1
  transformers==5.24.0
  truststore==0.10.5
  typing-inspection==0.4.5
)
mkdir -p "$DEST"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --implementation cp --dest "$DEST" "${WHEELS[@]}"
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "wheelhouse $DEST: $(ls "$DEST"/*.whl | wc -l) wheels, $((bytes / 1048576)) MiB (limit 64 MiB)"
if [ "$bytes" -gt $((64 * 1048576)) ]; then echo "wheelhouse over 64 MiB" >&2; exit 1; fi
