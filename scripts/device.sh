#!/usr/bin/env bash
# On a lent GPU machine (the device tool): configure, build with every core, run the GPU tests and the
# benchmarks named, and leave logs under $OUT. Prints a short summary last.
#   bash scripts/device.sh --tests 'Cuda|Gpu' --bench 'build-dev/bin/rdep bench gemm --json $OUT/gemm.json'
# Options (repeatable --bench; each runs in order, its output appended to $OUT/bench.log):
#   --tests REGEX     ctest -R filter (default: every test)
#   --targets "A B"   build only these targets (default: all)
#   --bench "CMD"     a shell command to run after the tests
#   --mpi "CMD"       like --bench, run after the benches (for mpirun commands)
#   --no-pytest       skip the Python package's tests (run by default after ctest when torch imports)
#   --no-eager-ext    skip building rdep.torch's eager C++ extension (~45 s; benches of the C++ CLI alone need none);
#                     rdep.torch then runs its Python path (RDEP_TORCH_EAGER_EXT=0 unless set)
#   --pytest-k EXPR   run only the Python tests pytest -k EXPR selects
#   --budget SECONDS  the whole script's wall-clock budget (default 570, under the device call's 600 s
#                     limit): each stage runs under `timeout` with what is left, so logs always come back
# CTEST_TIMEOUT (default 240) bounds each ctest test in seconds (a hung GPU test costs no more).
# PYTEST_ARGS adds arguments to pytest's command line (for example --durations 20).
# The device tool brings back at most 8 files from $OUT: this script writes 6 (env.txt, build.log, eager_ext.log,
# tests.log, pytest.log, bench.log); when the benches leave more than 2 others, those others go into one
# archive, $OUT/bench_files.tgz, so that the logs above always come back.
# The machine's copy of .git may be older than the tree: RDEP_COMMIT=<hash> names the receipts. Write the
# hash literally into the command (RDEP_COMMIT=$(git rev-parse ...) would run there, on the old .git).
# CUTLASS: carry the pinned wheel (.whl/, the device has no network: run with carry [".whl"]); the
# CUTLASS tests then fail rather than skip when the build lacks it (RDEP_REQUIRE_CUTLASS=1; set 0 to
# let them skip).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export RDEP_REQUIRE_CUTLASS=${RDEP_REQUIRE_CUTLASS:-1}
ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1 || [ -n "${RDEP_CUTLASS_DIR:-}" ] ||
  echo "device.sh: no .whl/nvidia_cutlass-*.whl (not carried?) and no RDEP_CUTLASS_DIR: the build will lack CUTLASS" >&2
TESTS="" TARGETS="" BENCH=() PYTEST=1 EAGER_EXT=1 PYTEST_K="" BUDGET=570
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) TESTS=$2; shift 2 ;;
    --targets) TARGETS=$2; shift 2 ;;
    --bench|--mpi) BENCH+=("$2"); shift 2 ;;
    --no-pytest) PYTEST=0; shift ;;
    --no-eager-ext) EAGER_EXT=0; shift ;;
    --pytest-k) PYTEST_K=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    *) echo "device.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
BUILD=build-dev
T_END=$(($(date +%s) + BUDGET))
left() { local l=$((T_END - $(date +%s) - ${1:-0})); [ $l -lt 5 ] && l=5; echo $l; }  # seconds left, less a reserve
{
  echo "== $(date -u +%FT%TZ) $(hostname)"; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m 2>/dev/null | head -12; nvcc --version | tail -2; cmake --version | head -1; g++ --version | head -1
  echo "git: $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) changed files; RDEP_COMMIT=${RDEP_COMMIT:-unset} (names the receipts when set)"
  python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())' 2>&1 | tail -1
  which mpirun 2>/dev/null && mpirun --version 2>/dev/null | head -1
} >"$OUT/env.txt" 2>&1
t0=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 || {
  echo "configure with tests failed; retrying without tests" | tee -a "$OUT/build.log"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRDEP_BUILD_TESTS=OFF >>"$OUT/build.log" 2>&1
}
if [ -n "$TARGETS" ]; then
  cmake --build "$BUILD" -j "$(nproc)" --target $TARGETS >>"$OUT/build.log" 2>&1; build_rc=$?
else
  cmake --build "$BUILD" -j "$(nproc)" >>"$OUT/build.log" 2>&1; build_rc=$?
fi
t1=$(date +%s)
test_rc=-1
if [ $build_rc -eq 0 ]; then
  timeout "$(left 60)" ctest --test-dir "$BUILD" ${TESTS:+-R "$TESTS"} --timeout "${CTEST_TIMEOUT:-240}" --output-on-failure -j 4 \
    >"$OUT/tests.log" 2>&1
  test_rc=$?
fi
# rdep.torch's eager C++ path (python/rdep/torch/eager_ext.py), compiled once into the build folder (kept while the
# machine stays warm) and required: a failed build fails the tests instead of leaving the Python path.
# With --no-eager-ext the extension is neither built nor asked for (RDEP_TORCH_EAGER_EXT=0: rdep.torch's Python path).
export TORCH_EXTENSIONS_DIR="$PWD/$BUILD/torch_extensions" RDEP_TORCH_EAGER_EXT=${RDEP_TORCH_EAGER_EXT:-$EAGER_EXT}
if [ $build_rc -eq 0 ] && [ $EAGER_EXT -eq 1 ] && python3 -c 'import torch' >/dev/null 2>&1; then
  te0=$(date +%s)
  RDEP_LIBRARY="$PWD/$BUILD/lib/librdep_capi.so" PYTHONPATH="$PWD/python" timeout "$(left 60)" \
    python3 -m rdep.torch build-eager-ext >"$OUT/eager_ext.log" 2>&1
  echo "[rc=$? in $(( $(date +%s) - te0 )) s]" >>"$OUT/eager_ext.log"
  tail -3 "$OUT/eager_ext.log" >>"$OUT/env.txt"
fi
# The Python package's tests (CUDA ones included) on the library just built, when torch is there.
pytest_rc=-1
if [ $build_rc -eq 0 ] && [ $PYTEST -eq 1 ] && python3 -c 'import torch, pytest' >/dev/null 2>&1; then
  RDEP_REQUIRE_LIBRARY=1 RDEP_LIBRARY="$PWD/$BUILD/lib/librdep_capi.so" PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1 \
    timeout "$(left 30)" python3 -m pytest python/tests -q -rfEsP -p no:cacheprovider -p no:logging ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-} \
    >"$OUT/pytest.log" 2>&1
  pytest_rc=$?
fi
t2=$(date +%s)
: >"$OUT/bench.log"
for cmd in "${BENCH[@]}"; do
  echo "\$ $cmd" >>"$OUT/bench.log"
  (eval "timeout $(left 10) $cmd") >>"$OUT/bench.log" 2>&1
  echo "[rc=$?]" >>"$OUT/bench.log"
done
t3=$(date +%s)
# At most 8 files come back: past that, what the benches wrote is archived (receipts_w4.sh archives its own).
own='^(env\.txt|build\.log|tests\.log|pytest\.log|bench\.log|eager_ext\.log)$'
extra=$(cd "$OUT" && find . -mindepth 1 -maxdepth 1 -printf '%P\n' | grep -vE "$own")
if [ "$(printf '%s\n' "$extra" | grep -c .)" -gt 2 ]; then
  (cd "$OUT" && printf '%s\n' "$extra" | tar czf bench_files.tgz -T - && printf '%s\n' "$extra" | xargs -d '\n' rm -rf)
  echo "device.sh: the benches' $(printf '%s\n' "$extra" | grep -c .) files are in \$OUT/bench_files.tgz" >>"$OUT/bench.log"
fi
echo "===== summary (build ${build_rc} in $((t1 - t0))s, tests ${test_rc} in $((t2 - t1))s, bench $((t3 - t2))s)"
grep -E "^-- rdep: .*(NCCL|CUTLASS|MPI)" "$OUT/build.log" | head -4
head -3 "$OUT/env.txt" | tail -2
[ $build_rc -ne 0 ] && grep -E "error|FAILED" "$OUT/build.log" | head -30
[ -f "$OUT/tests.log" ] && { grep -E "\((Failed|Timeout|Subprocess aborted|SEGFAULT)\)|\*\*\*" "$OUT/tests.log" | head -40; grep -E "tests passed|Total Test time" "$OUT/tests.log"; }
# -rfE names every failed or erroring test in pytest's summary (FAILED/ERROR lines), so the summary here does.
[ -f "$OUT/pytest.log" ] && { echo "pytest rc ${pytest_rc}:"; grep -E "^(FAILED|ERROR) " "$OUT/pytest.log" | head -15; grep -E "SKIPPED|passed|failed" "$OUT/pytest.log" | tail -6; }
tail -c 6000 "$OUT/bench.log"
