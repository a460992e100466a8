# Session 34, call 2 (one H200): tree 403ed48 plus the labs.
RDEP_COMMIT=403ed48+ltlab bash scripts/device.sh --targets "grouped_gemm_tiles lt_grouped_gemm" --tests NoSuchTestXYZ --no-pytest --bench 'bash call1.sh'
# call1.sh (L=build-dev/bench/lab):
#   $L/grouped_gemm_tiles --experts 1 --mu 24576 --roles g1,g2 --iters 20 --warmup 5
#   $L/lt_grouped_gemm --experts 1 --mu 24576 --roles g1,g2 --routing equal --iters 20 --warmup 5 --rounds 2
#   $L/lt_grouped_gemm --mu 384,1536 --roles g1,g2 --routing equal --iters 20 --warmup 5 --rounds 2
#   $L/lt_grouped_gemm --mu 384,1536 --roles g1,g2,dz,dx --iters 20 --warmup 5 --rounds 2
#   $L/grouped_gemm_tiles --mu 384,1536 --roles g1,g2 --iters 20 --warmup 5
