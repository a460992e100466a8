#!/usr/bin/env bash
# The test command: builds everything and runs every test with CTest. Tests that need a GPU skip
# (and say so) on a machine without one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
