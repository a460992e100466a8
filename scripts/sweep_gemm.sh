#!/usr/bin/env bash
# Issue 14, item 5: the expert-compute sweep, rdep beside torch._grouped_mm on the same per-expert counts,
# in one device call after scripts/device.sh built build-dev:
#   bash scripts/device.sh --tests CutlassExpertCompute --no-pytest --targets rdep \
#     --bench 'bash scripts/sweep_gemm.sh'
# E = 64 experts split over W = 1, 2, 4, 8 ranks (E_loc = 64, 32, 16, 8), H = 2048, D_ff = 1408 (Moonlight),
# mu = 128 ... 6144 rows per local expert, uniform and Zipf alpha 0.5, 1, 1.5, 2 counts; forward and
# forward+backward; rho and the dense ceiling from the rdep receipt. For each (E_loc, routing): rdep bench
# gemm --path PATHS (default cutlass), then bench/torch_grouped_mm.py --counts-from that receipt --backward.
# Receipts and logs (with nvidia-smi's clock and power log, smi.csv, and times.log) in one archive, $OUT/sweep_gemm.tgz; the table (bench/summarize_gemm_sweep.py) in
# $OUT/sweep_gemm.md. Environment: ELOC, ROUTINGS, MU, PATHS, ITERS, GRADS override the defaults. GRADS (default
# bf16): the weight gradients rdep's backward writes; bf16 is what torch._grouped_mm's autograd writes for bf16 weights.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
R=/tmp/sweep_gemm
rm -rf "$R" && mkdir -p "$R" "$OUT"
ELOC=${ELOC:-"64 32 16 8"}
ROUTINGS=${ROUTINGS:-"uniform zipf:0.5 zipf:1 zipf:1.5 zipf:2"}
MU=${MU:-128,384,768,1536,3072,6144}
PATHS=${PATHS:-cutlass}
ITERS=${ITERS:-30}
GRADS=${GRADS:-bf16}
RDEP=build-dev/bin/rdep
[ -x "$RDEP" ] || { echo "sweep_gemm: $RDEP missing (run through scripts/device.sh)"; exit 2; }
fails=0
# The GPU's clock, power and throttle reasons every 200 ms beside the runs (the power cap bounds long runs:
# docs/perf-notes.md, thirty-seventh session); each run's start and end, in nvidia-smi's format and local time, in times.log.
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw.instant,temperature.gpu,clocks_event_reasons.active --format=csv \
    -lms 200 >"$R/smi.csv" 2>&1 &
  SMI=$!
  trap 'kill $SMI 2>/dev/null' EXIT
fi
for e in $ELOC; do
  for rt in $ROUTINGS; do
    tag="E${e}_${rt/:/}"
    echo "[$tag rdep start $(date "+%Y/%m/%d %H:%M:%S.%3N")]" >>"$R/times.log"
    "$RDEP" bench gemm --experts "$e" --hidden 2048 --ffn 1408 --mu "$MU" --routing "$rt" --path "$PATHS" \
      --grads "$GRADS" --warmup 5 --iters "$ITERS" --json "$R/gemm_$tag.json" >"$R/gemm_$tag.log" 2>&1 || { fails=$((fails + 1)); tail -3 "$R/gemm_$tag.log"; }
    echo "[$tag torch start $(date "+%Y/%m/%d %H:%M:%S.%3N")]" >>"$R/times.log"
    python3 bench/torch_grouped_mm.py --counts-from "$R/gemm_$tag.json" --backward --warmup 5 --iters "$ITERS" \
      --json "$R/torch_$tag.json" >"$R/torch_$tag.log" 2>&1 || { fails=$((fails + 1)); tail -3 "$R/torch_$tag.log"; }
    echo "[$tag done $(date "+%Y/%m/%d %H:%M:%S.%3N")]" >>"$R/times.log"
    echo "[$tag done, $SECONDS s]"
    tar czf "$OUT/sweep_gemm.tgz" --warning=no-file-changed -C "$R" .  # after every pair: a timeout still returns what ran
  done
done
python3 bench/summarize_gemm_sweep.py "$R" | tee "$OUT/sweep_gemm.md"
echo "sweep_gemm: $fails failed commands"
[ "$fails" -eq 0 ]
