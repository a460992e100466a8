# Session 34, call 3 (one H200): tree 403ed48 plus the labs (bench/lab/cutlass_dense_gemm.cu, one executable per configuration).
RDEP_COMMIT=403ed48+denselab bash scripts/device.sh --targets "cutlass_dense_gemm_labs" --tests NoSuchTestXYZ --no-pytest --bench 'bash call1.sh'
# call1.sh: for c in coop_128x256_c1x1 coop_128x256_c1x2 coop_128x256_c2x1 coop_256x128_c2x1 coop_256x128_c1x2 ping_128x128_c1x1:
#             build-dev/bench/lab/cutlass_dense_gemm_$c --rounds 2 --iters 20
#           then coop_128x256_c1x1 with --raster m|n and --swizzle 1|2|8 (--rounds 1 --iters 20)
