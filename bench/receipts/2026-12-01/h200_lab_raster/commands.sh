# Session 34, call 4 (one H200): tree 403ed48 plus the labs plus a temporary switch (reverted, not committed) in
# src/experts/grouped_gemm_sm90_runner.cuh: RDEP_GROUPED_RASTER=m|n set the group tile scheduler's raster order.
RDEP_COMMIT=403ed48+raster bash scripts/device.sh --targets "rdep lt_grouped_gemm" --tests NoSuchTestXYZ --no-pytest --bench 'bash call1.sh'
# call1.sh (L=build-dev/bench/lab):
#   for r in m n: RDEP_GROUPED_RASTER=$r $L/lt_grouped_gemm --experts 1 --mu 24576 --roles g1,g2 --routing equal --iters 20 --warmup 5 --rounds 1
#   for r in m n m n: RDEP_GROUPED_RASTER=$r $L/lt_grouped_gemm --mu 128,384,768,1536,3072 --roles g1,g2,dz,dx --iters 20 --warmup 5 --rounds 1
#   for r in m n m n: RDEP_GROUPED_RASTER=$r build-dev/bin/rdep bench gemm --experts 16 --hidden 2048 --ffn 1408 \
#       --mu 128,384,768,1536,3072 --path cutlass --grads bf16 --iters 100 --warmup 10 --json $OUT/gemm_$r.json
#   python3 bench/torch_grouped_mm.py --counts-from $OUT/gemm_n.json --backward --iters 100 --warmup 10 --json $OUT/torch.json
# (gemm_m.json holds the second raster-m run; the first was overwritten.)
