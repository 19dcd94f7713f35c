#!/usr/bin/env bash
# Install the real `sglang` server for its CPU engine (`python -m engine_patches.launch
# --device cpu`, `kvgate up --engine sglang`, the real-engine tests).
#
#   PYTHON=.venv/bin/python bash engine_patches/install_sglang_cpu.sh
#
# `scripts/setup.sh --test` (and so CI) runs it; without it the tests that need it skip with
# this command as reason (and fail in CI).
#
# The sglang wheel pins a CUDA torch and CUDA kernel packages; none of those can run here,
# and together they are ~10 GB. So: sglang with --no-deps, a CPU torch, xgrammar with
# --no-deps (its metadata pulls in triton), and the packages the server imports. Three
# packages cannot be installed on a CPU machine: sgl_kernel (CUDA-only wheels), triton and
# torchvision (PyPI's build fails on the CPU torch); engine_patches/standins has import-only
# stand-ins for them, put on the path by the launcher only where the real ones are absent.
#
# Knobs: SGLANG_VERSION (0.5.23), TORCH_SPEC (torch==2.13.0: resolves to the local CPU
# wheel through pip's find-links here; elsewhere point PIP_EXTRA_INDEX_URL at a CPU index).
set -euo pipefail

PYTHON=${PYTHON:-python3}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PIP=("$PYTHON" -m pip install --quiet --disable-pip-version-check)

if "$PYTHON" - "$SGLANG_VERSION" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import version
assert version("sglang") == sys.argv[1]
import torch  # noqa: F401  (a CPU or CUDA build; either imports here)
import uvicorn, xgrammar, partial_json_parser  # noqa: F401,E401  (the server's own imports)
EOF
    echo "install_sglang_cpu: sglang $SGLANG_VERSION and torch already present"
    exit 0
fi

start=$(date +%s)
"${PIP[@]}" "$TORCH_SPEC"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
# transformers as this sglang pins it: it renders the chat templates the gateway mirrors.
TRANSFORMERS=$("$PYTHON" -c 'from importlib.metadata import requires
pins = [r.split(";")[0].replace(" ", "") for r in requires("sglang") or [] if r.startswith("transformers")]
print(pins[0] if pins else "transformers")')
# What the imports above really need (found by importing them in a bare venv).
"${PIP[@]}" numpy orjson psutil pybase64 requests packaging pillow ipython tqdm \
    pydantic fastapi starlette msgspec pyzmq aiohttp pyyaml \
    "$TRANSFORMERS" apache-tvm-ffi dill sentencepiece compressed-tensors gguf \
    uvicorn uvloop python-multipart openai partial_json_parser setproctitle einops jsonschema \
    soundfile prometheus-client
"${PIP[@]}" --no-deps "xgrammar==0.2.7"
echo "install_sglang_cpu: done in $(( $(date +%s) - start ))s"
