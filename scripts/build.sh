#!/usr/bin/env bash
# Configure and build rdep (Release-with-debug-info, Ninja). CUDA is used when nvcc is found.
# BUILD_DIR (default build) picks the folder; extra arguments go to the configure step; TARGET (default:
# everything) names the one target to build (scripts/rdep builds only `rdep`). The configure log is
# BUILD_DIR/configure.log (printed when the configure step fails).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build}
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ] && [ -z "${CUDACXX:-}" ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
GEN=()
if [ ! -f "$BUILD/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi
mkdir -p "$BUILD"
cmake -S . -B "$BUILD" "${GEN[@]}" "$@" >"$BUILD/configure.log" 2>&1 || { cat "$BUILD/configure.log"; exit 1; }
TARGETS=()
if [ -n "${TARGET:-}" ]; then TARGETS=(--target "$TARGET"); fi
cmake --build "$BUILD" -j "$(nproc)" "${TARGETS[@]}"
