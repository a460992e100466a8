# Session 36, call 4 (one H200), tree 5ffeb51: rdep check at W = 4 ranks sharing the GPU (CUTLASS compute: plain, --gate-in-expert, --overlap), then the training example with --grad-accum 4 (fp32 experts, then bf16-master)
RDEP_COMMIT=5ffeb51 bash scripts/device.sh --targets "rdep rdep_capi" --tests NoSuchTestXYZ --no-pytest --bench 'bash call4.sh' --budget 570
# call4.sh:
set -u
B=build-dev
for extra in "" "--gate-in-expert" "--overlap"; do
  echo "== rdep check --backend cuda --ranks 4 --expert-compute cutlass $extra"
  timeout 90 $B/bin/rdep check --backend cuda --ranks 4 --expert-compute cutlass $extra 2>&1 | tail -12
done
env GA_STEPS=60 bash scripts/receipts_w4.sh trainmwga
