#!/usr/bin/env bash
# Installs everything kvgate needs on a fresh Debian/Ubuntu machine into ./.venv:
# the Debian libraries Mooncake's CPU wheel loads at import time, then the project.
#   scripts/setup.sh          the gateway, simulator and Mooncake (what `kvgate up` needs)
#   scripts/setup.sh --test   also the test extras and the CPU subset of the real `sglang`
#                             package that tests/test_engine_*.py import (~2 min, ~1.5 GB),
#                             and SMG as --bench puts it (tests/test_sim_smg_compat.py)
#   scripts/setup.sh --bench  also the bench extras, and SMG (the pinned `smg` wheel) in
#                             ./.venv-smg, its own venv: sglang-router's wheel installs an
#                             unrelated `smg` console script (bench/services.py finds it there)
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

WITH_TESTS=0
WITH_BENCH=0
[ "${1:-}" = "--test" ] && WITH_TESTS=1
[ "${1:-}" = "--bench" ] && WITH_BENCH=1
SMG_VERSION=1.13.0

PY=${PYTHON:-python3}
DEB_PKGS="libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200"

missing=""
if command -v dpkg-query >/dev/null 2>&1; then
  for p in $DEB_PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
  done
fi
if [ -n "$missing" ]; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  echo "setup: installing Debian packages:$missing"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

install_smg() {
  [ -x .venv-smg/bin/python ] || "$PY" -m venv .venv-smg
  .venv-smg/bin/python -m pip install -q "smg==$SMG_VERSION"
  .venv-smg/bin/python -m smg launch --help >/dev/null
  echo "setup: smg $SMG_VERSION in .venv-smg"
}

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if [ "$WITH_TESTS" = 1 ]; then
  .venv/bin/python -m pip install -q -e ".[mooncake,hf,test]"
  PYTHON=.venv/bin/python bash engine_patches/install_sglang_cpu.sh
  install_smg
elif [ "$WITH_BENCH" = 1 ]; then
  .venv/bin/python -m pip install -q -e ".[mooncake,hf,bench]"
  install_smg
else
  .venv/bin/python -m pip install -q -e ".[mooncake,hf]"
fi
echo "setup: ready (.venv/bin/kvgate)"
