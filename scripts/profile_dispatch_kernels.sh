#!/usr/bin/env bash
# Per-kernel GPU times of one rank's sentinel forward (routing, scatter, expansion, echo, return, combine)
# under Nsight Compute, at the Moonlight and DeepSeek-V3 shapes, W = 1 (ncu serializes kernels, so ranks
# that wait on each other in a device barrier cannot be profiled together). Run on the device after
# scripts/device.sh has built build-dev:
#   bash scripts/device.sh --bench 'bash scripts/profile_dispatch_kernels.sh'
# Writes $OUT/profile_kernels.txt: per shape, each kernel's mean gpu__time_duration over its launches.
# --clock-control none: the clocks are left alone (the device pages say so), so a short kernel after an
# idle gap may read a little slow.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
RDEP=build-dev/bin/rdep
[ -x "$RDEP" ] || { echo "profile_dispatch_kernels: $RDEP missing (run through scripts/device.sh)"; exit 2; }
command -v ncu >/dev/null || { echo "profile_dispatch_kernels: ncu not on PATH"; exit 2; }
REPORT=$OUT/profile_kernels.txt
: >"$REPORT"
profile() {  # profile NAME rdep-bench-dispatch-flags...
  local name=$1; shift
  local raw=/tmp/ncu_$name.txt
  echo "== $name: rdep bench dispatch --ranks 1 --no-nccl --warmup 2 --iters 5 $*" >>"$REPORT"
  ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    "$RDEP" bench dispatch --ranks 1 --no-nccl --warmup 2 --iters 5 "$@" >"$raw" 2>&1 || { tail -20 "$raw" >>"$REPORT"; return 1; }
  # "  ns::<unnamed>::NameKernel(args) (grid)x(block), ..., Invocations N" then "    gpu__time_duration.sum  us  min max avg"
  awk '/Invocations/ { name = $1; sub(/\(.*/, "", name); sub(/.*::/, "", name); inv = $NF; next }
       /gpu__time_duration.sum/ && name != "" { printf "  %-34s %8s us mean (%s launches; min %s, max %s)\n", name, $NF, inv, $(NF-2), $(NF-1); name = "" }' \
    "$raw" >>"$REPORT"
}
profile moonlight --tokens 4096 --hidden 2048 --experts 64 --topk 6
profile dsv3 --tokens 4096 --hidden 7168 --experts 256 --topk 8
cat "$REPORT"
