#!/usr/bin/env bash
# Can the pipeline's tests fail? On a GPU machine, after scripts/device.sh has built build-dev:
#   bash scripts/device.sh --tests '^NONE$' --no-pytest --bench 'bash scripts/mutate_overlap.sh'
# Each mutation deletes one of the cross-stream waits of src/layer/cuda_overlap.cc that guard a race, rebuilds layer_test and runs
# the overlap tests whose streams are held back (CudaOverlap.*_late: SetPipelineDelaysForTesting); they
# must now fail. The file is restored (and layer_test rebuilt) at the end. Prints one line per mutation;
# exits 1 if a mutation was not caught or could not be applied.
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=src/layer/cuda_overlap.cc
BIN=build-dev/src/layer/layer_test
ORIG=$(mktemp)
cp "$SRC" "$ORIG"
restore() { cp "$ORIG" "$SRC"; }
trap restore EXIT
fails=0
mutate() {  # NAME 'exact line to delete'
  local name=$1 line=$2
  restore
  if ! python3 - "$SRC" "$line" <<'EOF'
import sys
path, line = sys.argv[1], sys.argv[2]
text = open(path).read()
if text.count(line) != 1:
    sys.exit(f"{line!r} found {text.count(line)} times")
open(path, "w").write(text.replace(line, "    // (mutated: a wait removed)"))
EOF
  then echo "mutation $name: not applied"; fails=$((fails + 1)); return; fi
  if ! cmake --build build-dev --target layer_test >"/tmp/mutate_$name.build.log" 2>&1; then
    echo "mutation $name: build failed"; tail -n 5 "/tmp/mutate_$name.build.log"; fails=$((fails + 1)); return
  fi
  if timeout 300 "$BIN" --gtest_filter='Cuda_bf16/CudaOverlap.*_late*' >"/tmp/mutate_$name.log" 2>&1; then
    echo "mutation $name: NOT caught (the delayed tests passed without the wait)"; fails=$((fails + 1))
  else
    echo "mutation $name: caught ($(grep -c '^\[  FAILED  \] Cuda_bf16.* ms)$' "/tmp/mutate_$name.log") failed cases; first: $(grep -m1 -A1 'Failure' "/tmp/mutate_$name.log" | tail -1))"
  fi
}
mutate computed_before_return '    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(comm, ev.computed, 0));'
mutate read_before_barrier '    if (seg > 0) RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(comm, ev.read, 0));  // segment seg-1'"'"'s half is read'
mutate dispatched_before_compute '    RDEP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(comp, ev.dispatched, 0));'
# Not mutated: the wait for the return of s-2 before compute s. The domain's stream returns s-2 before it
# scatters s, so "dispatched s" already implies it; without the explicit wait no race exists to catch
# (measured: the mutation passed, 2026-11-28). It stays in cuda_overlap.cc against a reordering.
restore
cmake --build build-dev --target layer_test >/tmp/mutate_restore.log 2>&1 || { echo "restore build failed"; fails=$((fails + 1)); }
if timeout 300 "$BIN" --gtest_filter='Cuda_bf16/CudaOverlap.*_late*' >/tmp/mutate_clean.log 2>&1; then
  echo "unmutated: the delayed cases pass ($(grep -c '^\[       OK \]' /tmp/mutate_clean.log) cases)"
else
  echo "unmutated: the delayed cases FAIL"; tail -n 20 /tmp/mutate_clean.log; fails=$((fails + 1))
fi
exit $((fails > 0))
