#!/usr/bin/env bash
# The GPU tests under compute-sanitizer: memcheck (out-of-bounds and misaligned accesses, including the
# transport's stores into other ranks' regions, which ranks sharing one GPU make plain device memory),
# racecheck (shared-memory hazards in the kernels that use it), synccheck (barriers under divergence) and
# initcheck (reads of device memory nothing wrote). Run on the device after scripts/device.sh has built
# build-dev:
#   bash scripts/device.sh --no-pytest --tests NONE --bench 'bash scripts/sanitize.sh'
#   bash scripts/sanitize.sh [memcheck|racecheck|synccheck|initcheck]...   (default: all four)
# Each run is one test binary with a gtest filter chosen to reach every kernel at a small shape (the
# sanitizers slow kernels by 10-100x, and ranks on one GPU keep every exchange in one process). A run
# passes when the tool reports no error and the tests pass; the tool's verdict is its exit code
# (--error-exitcode), so a test that fails for another reason is told apart. Writes
# $OUT/sanitize.txt: a line per run (tool, binary, filter, seconds, verdict, the tool's error summary),
# and the first errors of any run that found some. Exit 1 when any run did not pass, 2 when compute-sanitizer
# is missing or a tool is not one of the four.
# CUDA API errors are not reported (--report-api-errors no): rdep checks every call's return itself, and the one
# error it tolerates, cudaErrorPeerAccessAlreadyEnabled when a later domain of the process enables a GPU pair
# again, made memcheck count 324 errors in the validation matrix on two GPUs (thirtieth session).
# SANITIZE_TIMEOUT (default 150) bounds each run in seconds; a run cut short is reported as TIMEOUT.
# SANITIZE_ONLY (an extended regex) keeps the runs whose "tool binary|filter" matches it.
# SANITIZE_PRINT_LIMIT (default 2000): errors the tool prints a run; a failed run's report counts their sites (the
# test is "?" for a kernel launched from a rank's thread, whose backtrace has no TestBody frame).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
B=build-dev/src
REPORT=$OUT/sanitize.txt
: >"$REPORT"
LIMIT=${SANITIZE_TIMEOUT:-150}
PRINT_LIMIT=${SANITIZE_PRINT_LIMIT:-2000}  # errors printed a run: the report's error sites are counted over these
TOOLS=("$@")
[ ${#TOOLS[@]} -eq 0 ] && TOOLS=(memcheck racecheck synccheck initcheck)
for tool in "${TOOLS[@]}"; do
  case $tool in memcheck|racecheck|synccheck|initcheck) ;; *) echo "sanitize: unknown tool '$tool' (memcheck, racecheck, synccheck, initcheck)" | tee -a "$REPORT"; exit 2 ;; esac
done
command -v compute-sanitizer >/dev/null || { echo "sanitize: compute-sanitizer not on PATH" | tee -a "$REPORT"; exit 2; }
failed=0

# run TOOL BINARY FILTER: one binary's tests under one tool.
run() {
  local tool=$1 bin=$2 filter=$3 log rc t0 verdict summary exe
  exe=$(find "$B" -name "$bin" -type f -perm -u+x | head -1)
  [ -n "$exe" ] || { printf '%-9s %-28s %-52s missing (not built)\n' "$tool" "$bin" "$filter" >>"$REPORT"; failed=1; return; }
  log=$(mktemp)
  t0=$(date +%s)
  timeout -k 15 "$LIMIT" compute-sanitizer --tool "$tool" --error-exitcode 86 --print-limit "$PRINT_LIMIT" --report-api-errors no \
    "$exe" --gtest_filter="$filter" --gtest_brief=1 >"$log" 2>&1
  rc=$?
  case $rc in
    0) verdict=pass ;;
    86) verdict="ERRORS" ;;
    124|137) verdict="TIMEOUT after ${LIMIT}s" ;;
    *) verdict="tests failed (rc $rc)" ;;
  esac
  summary=$(grep -m1 -E "(ERROR|RACECHECK) SUMMARY: [0-9]+" "$log")
  local ran
  ran=$(grep -E "^\[  PASSED  \]" "$log" | tail -1)
  printf '%-9s %-28s %-52s %4ss  %-22s %s | %s\n' "$tool" "$bin" "$filter" "$(($(date +%s) - t0))" "$verdict" \
    "${summary:-no summary}" "${ran:-}" >>"$REPORT"
  if [ "$verdict" != pass ]; then
    failed=1
    { echo "---- $tool $bin $filter: error sites among the first $PRINT_LIMIT errors printed (count | kind | where | test)"
      awk 'function flush() { if (kind != "") print kind " | " site " | " test; kind = "" }
           /^========= [A-Z][a-z].*(read|write|access|hazard|barrier|error)/ {flush(); kind=$0; sub(/^========= /, "", kind); site=""; test="?"}
           /^=========     at / && kind != "" && site == "" {site=$0; sub(/^=========     at /, "", site); sub(/\(.*\)\+/, "+", site)}
           /Host Frame:.*_Test::TestBody/ && kind != "" {test=$0; sub(/.*Host Frame: */, "", test); sub(/::TestBody.*/, "", test); sub(/.*::/, "", test)}
           END {flush()}' "$log" | sort | uniq -c | sort -rn | head -20
      echo "---- $tool $bin $filter: first lines of the tool's report"; grep -E "^=========" "$log" | grep -vE "ERROR SUMMARY|COMPUTE-SANITIZER" | head -40
      grep -E "^\[  FAILED  \]|Failure|Expected|error:" "$log" | head -10; tail -5 "$log"; } >>"$REPORT"
  fi
  rm -f "$log"
}

# The protocol's kernels one by one against the host (dispatch_test), the routing kernels, the layer at
# W = 1, 2, 4 with ranks sharing the GPU (the validation matrix's small cases), the owner's reduce, the
# per-source windows, the overlapped segments and the CUTLASS expert kernels at their smallest cases.
# A set is "tools|binary|filter": the tools it runs under. racecheck skips the router's largest cases and the
# validation matrix (its shared-memory tracking took each over 80 s on an H200). initcheck leaves out the cuBLASLt
# expert tests with rows (ExpertMlp E4_*): initcheck does not see TMA bulk stores, which cuBLASLt's Hopper kernels
# write their outputs with, so every later read of a cuBLASLt output is reported as uninitialized
# (bench/lab/initcheck_probe.cu, thirty-first session: a TMA bulk store's buffer and cuBLASLt's outputs at two shapes
# reported whole, a kernel's plain stores not; every value checked on the host).
SETS=(
  "memcheck|racecheck|synccheck|initcheck|dispatch_test|*"
  "memcheck|synccheck|initcheck|router_kernel_test|*"
  "racecheck|router_kernel_test|*-*T20000*:*T5000*:*T2000*:*Timing*"
  "memcheck|synccheck|initcheck|testing_test|*CudaValidation.*:*CudaBalanceValidation.*"
  "memcheck|initcheck|layer_test|*CudaOwnerReduce*:*CudaSourceWindows*:*CudaRows*"
  "memcheck|initcheck|layer_test|*CudaOverlap*:*CudaGateInExpert*:*CudaMoELayerInput*"
  "memcheck|experts_test|*ExpertMlp_Cuda_bf16.E3_*:*ExpertMlp_Cuda_bf16.E4_*:*CutlassExpertCompute_Faults*:*CutlassGateBeforeW2*"
  "initcheck|experts_test|*ExpertMlp_Cuda_bf16.E3_*:*CutlassExpertCompute_Faults*:*CutlassGateBeforeW2*"
)
for tool in "${TOOLS[@]}"; do
  for set in "${SETS[@]}"; do
    set_tools=${set%|*|*} rest=${set#"${set%|*|*}|"}
    [[ "|$set_tools|" == *"|$tool|"* ]] || continue
    [[ "$tool $rest" =~ ${SANITIZE_ONLY:-.} ]] || continue
    run "$tool" "${rest%%|*}" "${rest#*|}"
  done
done
cat "$REPORT"
exit $failed
