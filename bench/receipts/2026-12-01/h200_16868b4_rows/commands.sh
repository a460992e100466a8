# Session 34, call 8 (one H200): tree 16868b4 (rdep bench gemm's rows% column).
RDEP_COMMIT=16868b4 bash scripts/device.sh --targets "rdep" --tests NoSuchTestXYZ --no-pytest \
  --bench 'build-dev/bin/rdep bench gemm --experts 16 --hidden 2048 --ffn 1408 --mu 0,128,1536 --path cutlass --grads bf16 --iters 50 --warmup 10 --json $OUT/gemm.json' --budget 170
