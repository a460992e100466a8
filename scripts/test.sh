#!/usr/bin/env bash
# The test command: builds everything, runs every C++ test with CTest, then the Python package's tests
# (pytest: rdep.torch against a plain PyTorch reference, on the library just built). Tests that need a
# GPU skip on a machine without one; each skipped test is listed with the reason it gave. Without
# PyTorch the Python tests are reported as not run (and fail the command under CI=true).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD_DIR:-build}
bash scripts/build.sh "$@"
rc=0
ctest --test-dir "$BUILD" --output-on-failure -j "$(nproc)" || rc=$?
# GoogleTest prints "FILE:LINE: Skipped" and then the reason; CTest keeps it in LastTest.log only.
log="$BUILD/Testing/Temporary/LastTest.log"
if [ -f "$log" ] && grep -q ': Skipped$' "$log"; then
  echo "skipped tests and why:"
  awk '/^[0-9]+\/[0-9]+ Test: / { sub(/^[0-9]+\/[0-9]+ Test: /, ""); sub(/  # GetParam.*/, ""); name = $0 }
       want { print "  " name ": " $0; want = 0 }
       /: Skipped$/ { want = 1 }' "$log"
fi
if python3 -c 'import torch' >/dev/null 2>&1; then
  echo "python tests: $(python3 -c 'import torch; print("torch", torch.__version__)')"
  RDEP_REQUIRE_LIBRARY=1 RDEP_LIBRARY="$PWD/$BUILD/lib/librdep_capi.so" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" \
    python3 -m pytest python/tests examples/torch_training -q -rs -p no:cacheprovider || rc=$?
else
  echo "python tests: NOT RUN, PyTorch is not installed here (python3 -m pip install torch pytest numpy; .ci/run does)"
  if [ -n "${CI:-}" ]; then rc=1; fi
fi
exit "$rc"
