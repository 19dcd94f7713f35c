#!/usr/bin/env bash
# Install the real `sglang` package so tests/test_engine_*.py can import it on a CPU box.
#
#   PYTHON=.venv/bin/python bash engine_patches/install_sglang_cpu.sh
#
# Measured on the 2-core dev box (pip cache warm, fresh venv): 111 s, 1.5 GB. `scripts/setup.sh
# --test` (and so CI) runs it; without it the tests that need it skip with this command as reason.
#
# The sglang wheel pins a CUDA torch and CUDA kernel packages; none of those can run here,
# and together they are ~10 GB. So: sglang with --no-deps, a CPU torch, and only the small
# packages that `sglang.srt.server_args`, `...managers.cache_controller`,
# `...disaggregation.kv_events` and `...mem_cache.hicache_storage` import. `triton` is NOT
# installed (1 GB), nor `torchvision` (its PyPI build needs the CUDA torch): tests put
# tests/shims (import-only stand-ins) on sys.path when the real ones are absent.
# No SGLang *server* can run on such a CPU (there is no CPU sgl-kernel wheel).
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
    "$TRANSFORMERS" apache-tvm-ffi dill sentencepiece compressed-tensors gguf
echo "install_sglang_cpu: done in $(( $(date +%s) - start ))s"
