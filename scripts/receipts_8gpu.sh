#!/usr/bin/env bash
# The 8-GPU receipts (issue 5) in one device call on nvidia-h200-x8, from the repository root:
#   1. `rdep check --backend cuda` at W = 8, one process and one process per GPU under mpirun (CUDA
#      IPC), for E = 64 (Moonlight shape at T = 32) and a non-divisible E = 62;
#   2. `rdep bench layer`, forward and forward+backward, each beside the PyTorch EP baseline
#      (torchrun --nproc-per-node=W, shared/baselines/torch_ep_moe.py) in the same call: the pooling
#      sweep E = 64, T = 4096/rank, K = 6, W = 1, 2, 4, 8 (seeds 000 Tables 9 and 10) and the Zipf
#      sweep alpha = 0.5, 1, 1.5, 2 at W = 8 (Tables 11 and 12);
#   3. `rdep bench dispatch` at W = 8 for the Moonlight and DeepSeek-V3 shapes.
# Receipts (JSON) and logs go to one archive, $OUT/receipts_8gpu.tgz (the device tool brings back at
# most 8 files), plus $OUT/receipts_8gpu.txt with every command and its summary lines.
# WMAX=4 rehearses the same at W <= 4 on nvidia-h200-x4 (checks and sweeps at W = WMAX).
# The baseline must travel: copy ../shared/baselines into ./shared/baselines (ignored) and name
# `shared` in the device tool's carry. Builds build-dev (target rdep) first.
# Note on the Zipf sweep: rdep's zipf:ALPHA draws one popularity permutation for all ranks (seeded),
# the baseline one per rank (torch generator 1234 + rank); both are Zipf(alpha) over the experts, but
# a shared permutation concentrates the hot experts, so rdep's owners carry the more skewed load. The
# layer receipts record it (routing_load: expert and owner max/mean); compare with that in mind.
set -uo pipefail
cd "$(dirname "$0")/.."
WMAX=${WMAX:-8}
OUT=${OUT:-$PWD/out}
R=/tmp/receipts_8gpu
rm -rf "$R" && mkdir -p "$R" "$OUT"
LOG=$OUT/receipts_8gpu.txt
: >"$LOG"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
BASE=shared/baselines/torch_ep_moe.py
[ -f "$BASE" ] || { echo "receipts_8gpu: $BASE missing (carry shared/)" | tee -a "$LOG"; exit 2; }
ngpu=$(nvidia-smi -L | wc -l)
[ "$ngpu" -ge "$WMAX" ] || { echo "receipts_8gpu: $ngpu GPUs, WMAX=$WMAX needs more" | tee -a "$LOG"; exit 2; }
# Configure and build every time (a no-op when build-dev is current; a kept build-dev may be older).
cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release >"$R/build.log" 2>&1 &&
  cmake --build build-dev -j "$(nproc)" --target rdep >>"$R/build.log" 2>&1 ||
  { tail -20 "$R/build.log" | tee -a "$LOG"; echo "receipts_8gpu: build failed" >>"$LOG"; exit 1; }
RDEP=build-dev/bin/rdep
fails=0
run() {  # run NAME CMD...: full output to $R/NAME.log, the command and its last lines to $LOG
  local name=$1; shift
  echo "\$ $*" >>"$LOG"
  local t0=$SECONDS
  "$@" >"$R/$name.log" 2>&1
  local rc=$?
  { grep -E "^  (forward|load:|rdep dispatch|rdep combine|nccl all)|passed, |baseline W=" "$R/$name.log" ||
      tail -n 4 "$R/$name.log"; } >>"$LOG"
  echo "[$name rc=$rc, $((SECONDS - t0)) s]" >>"$LOG"
  [ $rc -eq 0 ] || fails=$((fails + 1))
}
mpi=(mpirun --allow-run-as-root --bind-to none -np "$WMAX")
W=$WMAX

# 1. Validation at W = WMAX.
run check_w${W}_e64 "$RDEP" check --backend cuda --ranks "$W" --tokens 32 --hidden 2048 --ffn 1408 --experts 64 --topk 6 --json "$R/check_w${W}_e64.json"
run check_w${W}_e62 "$RDEP" check --backend cuda --ranks "$W" --tokens 64 --hidden 256 --ffn 128 --experts 62 --topk 6 --json "$R/check_w${W}_e62.json"
run check_mpi_w${W}_e64 "${mpi[@]}" "$RDEP" check --bootstrap mpi --tokens 32 --hidden 2048 --ffn 1408 --experts 64 --topk 6 --json "$R/check_mpi_w${W}_e64.json"
run check_mpi_w${W}_e62 "${mpi[@]}" "$RDEP" check --bootstrap mpi --tokens 64 --hidden 256 --ffn 128 --experts 62 --topk 6 --capacity-factor 1.1 --segment 16 --json "$R/check_mpi_w${W}_e62.json"

# 2. The layer beside its baseline: pooling sweep (uniform, E = 64), then the Zipf sweep at W = WMAX.
layer() {  # layer TAG W [--routing zipf:A]
  local tag=$1 w=$2; shift 2
  local zipf=0
  [ $# -gt 0 ] && zipf=${2#zipf:}
  run torch_$tag torchrun --nproc-per-node="$w" "$BASE" --zipf "$zipf" --json "$R/torch_$tag.json"
  run layer_$tag "$RDEP" bench layer --ranks "$w" "$@" --json "$R/layer_$tag.json" --baseline-json "$R/torch_$tag.json"
}
for w in 1 2 4 8; do
  [ "$w" -le "$WMAX" ] && layer pool_w$w "$w"
done
for a in 0.5 1 1.5 2; do
  layer zipf${a}_w$W "$W" --routing "zipf:$a"
done

# 3. Dispatch and combine alone beside NCCL's all-to-allv.
run dispatch_moonlight_w$W "$RDEP" bench dispatch --ranks "$W" --tokens 4096 --hidden 2048 --experts 64 --topk 6 --warmup 20 --iters 100 --json "$R/dispatch_moonlight_w$W.json"
run dispatch_dsv3_w$W "$RDEP" bench dispatch --ranks "$W" --tokens 4096 --hidden 7168 --experts 256 --topk 8 --warmup 20 --iters 100 --json "$R/dispatch_dsv3_w$W.json"

{
  echo "== receipts_8gpu: WMAX=$WMAX, $fails failed commands"
  nvidia-smi --query-gpu=index,name --format=csv,noheader | head -8
  nvidia-smi topo -m 2>/dev/null | head -$((WMAX + 1))
} >>"$LOG"
tar czf "$OUT/receipts_8gpu.tgz" -C "$R" .
cat "$LOG"
[ "$fails" -eq 0 ]
