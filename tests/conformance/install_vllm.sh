#!/usr/bin/env bash
# Builds the conformance tier's venv: vLLM's real OpenAI server code (the wheel, --no-deps) on the CPU torch wheel,
# with vLLM's own requirement list minus the GPU-only packages. The engine core is swapped in the tests
# (tests/conformance/fake_engine.py); everything from AsyncLLM up is vLLM's. Idempotent: cached in .venv-vllm.
set -euo pipefail
VENV=${1:-.venv-vllm}
PY=${PY:-python3}
VLLM_VERSION=0.33.0
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -f "$VENV/.installed-$VLLM_VERSION" ] && exit 0
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip packaging
"$PIP" install -q "$TORCH_SPEC"
"$PIP" install -q --no-deps "vllm==$VLLM_VERSION"
# vLLM's Requires-Dist, read from the installed metadata, without the GPU-only packages and without torch (the CPU
# wheel above stays: a constraint keeps pip from replacing it).
GPU_ONLY='^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer-python|apache-tvm-ffi|tilelang|nvidia-.*|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels|numba)$'
REQS=$("$VENV/bin/python" - "$GPU_ONLY" <<'PY'
import re, sys
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = re.compile(sys.argv[1], re.I)
out = []
for line in requires("vllm") or []:
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
touch "$VENV/.installed-$VLLM_VERSION"
