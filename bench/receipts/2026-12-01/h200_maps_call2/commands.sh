# Session 35, call 2 (one H200): call 1's tree with the descriptors' kernel launched with PDL (as committed; the default
# still `kernel` then, flipped to `prebuilt` after this call on these figures).
RDEP_COMMIT=34ef676+maps2 bash scripts/device.sh --targets "rdep experts_test group_maps_ab" --tests 'GroupedGemmSm90|CutlassExpertCompute' --no-pytest --bench 'bash call1.sh'
# call1.sh (B=build-dev):
#   $B/bench/lab/group_maps_ab --mu 128,384,1536 --rounds 3 --iters 30 --warmup 5
#   for m in kernel prebuilt kernel prebuilt: RDEP_GROUPED_GEMM_MAPS=$m $B/bin/rdep bench gemm --experts 16 --hidden 2048 \
#       --ffn 1408 --mu 128,384,768,1536,3072 --path cutlass --grads bf16 --iters 100 --warmup 10 --json $OUT/gemm_$m.json
#   for m in kernel prebuilt kernel prebuilt: RDEP_GROUPED_GEMM_MAPS=$m $B/bin/rdep bench layer --ranks 1 --expert-compute cutlass \
#       --grads bf16 --iters 50 --json $OUT/layer_$m.json
#   RDEP_GROUPED_GEMM_MAPS=prebuilt $B/bin/rdep check --backend cuda --ranks 1
# (each gemm_*.json and layer_*.json holds the second run of its kind; bench.log has all)
