# Session 35, call 1 (one H200): tree 34ef676 plus the prebuilt TMA descriptors (GroupedGemmMaps, uncommitted then; the
# default was still `kernel`, so the ctest run below exercised CUTLASS's in-kernel rewrite and the runs under
# RDEP_GROUPED_GEMM_MAPS=prebuilt the new path).
RDEP_COMMIT=34ef676+maps bash scripts/device.sh --targets "rdep experts_test group_maps_ab" --tests 'GroupedGemmSm90|CutlassExpertCompute' --no-pytest --bench 'bash call1.sh'
# call1.sh (B=build-dev):
#   RDEP_GROUPED_GEMM_MAPS=prebuilt $B/src/experts/experts_test --gtest_filter='*CutlassExpertCompute*:*GroupedGemmSm90*:*CutlassGate*:*Swiglu*'
#   $B/bench/lab/group_maps_ab --mu 128,384,768,1536,3072 --rounds 2 --iters 30 --warmup 5
#   $B/bench/lab/group_maps_ab --mu 384,1536 --rounds 2 --iters 30 --warmup 5 --routing equal --wgrad-beta 1
#   for m in kernel prebuilt kernel prebuilt: RDEP_GROUPED_GEMM_MAPS=$m $B/bin/rdep bench gemm --experts 16 --hidden 2048 \
#       --ffn 1408 --mu 128,384,768,1536,3072 --path cutlass --grads bf16 --iters 100 --warmup 10 --json $OUT/gemm_$m.json
# (each gemm_*.json holds the second run of its kind; bench.log has all four)
