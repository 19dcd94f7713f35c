#!/usr/bin/env bash
# kvgate --processes 1, 2, 4, 8 against sglang-router and SMG, every router on the same 8 CPUs
# (bench/overhead.py), on a machine with 16 CPUs or more. About 4-5 minutes.
#
# CPUs: wrk on 0-2 (3 threads, 256 connections), 5 stub backends on 3-7, every router on 8-15
# (the Rust routers size their thread pools to those 8). Tests: non-stream req/s and 16-chunk
# SSE streams/s, 3 x 5 s each, variants interleaved. The table goes to $OUT/scaling.md, the
# per-run lines to $OUT/scaling.log.
#
# Needs: this checkout's dependencies and sglang-router==0.3.2 in $PYTHON (default python3),
# smg==1.13.0 in $SMG_PYTHON (default: $PYTHON; `python -m smg launch` must work there),
# wrk and taskset on PATH.
#
#     OUT=/tmp/out PYTHON=.venv/bin/python SMG_PYTHON=/opt/smg/bin/python bash bench/scaling_16cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SMG_PYTHON=${SMG_PYTHON:-$PYTHON}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
cpus=$("$PYTHON" -c 'import os; print(len(os.sched_getaffinity(0)))')
if [ "$cpus" -lt 16 ]; then echo "needs 16 CPUs, this process may use $cpus" >&2; exit 1; fi
for tool in wrk taskset; do command -v "$tool" >/dev/null || { echo "$tool not found" >&2; exit 1; }; done
"$SMG_PYTHON" -c 'import smg' || { echo "no smg package in $SMG_PYTHON" >&2; exit 1; }
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 600 "$PYTHON" -m bench.overhead \
  --variants sglang-router smg --kvgate-processes 1 2 4 8 --smg-python "$SMG_PYTHON" \
  --stubs 5 --stub-cpus 3-7 --server-cpus 8-15 --load-cpu 0-2 --load-threads 3 --concurrency 256 \
  --tests rps sse --chunks 16 --reps 3 --duration 5 \
  --results "$OUT/scaling.md" --section scaling --title "kvgate processes vs sglang-router and SMG on 8 CPUs" \
  2>&1 | tee "$OUT/scaling.log"
