#!/usr/bin/env bash
# Configure and build rdep (Release-with-debug-info, Ninja). CUDA is used when nvcc is found.
# BUILD_DIR (default build) picks the folder; extra arguments go to the configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build}
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ] && [ -z "${CUDACXX:-}" ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
GEN=()
if [ ! -f "$BUILD/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi
cmake -S . -B "$BUILD" "${GEN[@]}" "$@" >"${BUILD}.configure.log" 2>&1 || { cat "${BUILD}.configure.log"; exit 1; }
cmake --build "$BUILD" -j "$(nproc)"
