#!/usr/bin/env bash
# The test command: builds everything and runs every test with CTest. Tests that need a GPU skip on a
# machine without one; after the run, each skipped test is listed with the reason it gave.
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
exit "$rc"
