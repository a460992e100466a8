# Session 36, call 1 (one H200), tree 8a6bc3f + dz's SwiGLU' epilogue (commit 2 of the session, without the L2 prefetch):
CTEST_TIMEOUT=120 RDEP_COMMIT=8a6bc3f+gradepi bash scripts/device.sh --budget 580 --targets "rdep experts_test group_maps_ab" \
  --tests "CutlassSwigluGradEpilogue|ExpertCompute|GroupedGemmSm90|CutlassExpertCompute|CutlassSwigluEpilogue|CutlassGate|ExpertMlp" \
  --no-pytest --bench 'bash call1.sh'
# call1.sh:
B=build-dev
timeout 60 $B/bench/lab/group_maps_ab --mu 128,1536 --rounds 1 --iters 30 --warmup 5
P='cutlass,cutlass://+epi///,cutlass://ping_128x128///,cutlass://ping_128x128+epi///,cutlass://coop_128x256+epi///'
Q='cutlass://coop_128x256+epi///,cutlass://ping_128x128+epi///,cutlass://ping_128x128///,cutlass://+epi///,cutlass'
for i in 1 2; do
  [ $i = 1 ] && paths=$P || paths=$Q
  $B/bin/rdep bench gemm --experts 16 --hidden 2048 --ffn 1408 --mu 128,384,768,1536,3072 --path "$paths" \
    --grads bf16 --iters 50 --warmup 10 --json $OUT/gemm_$i.json
done
python3 bench/torch_grouped_mm.py --counts-from $OUT/gemm_2.json --backward --iters 50 --warmup 10 --json $OUT/torch.json
n=0
for t in default epi default epi; do
  n=$((n + 1))
  [ $t = epi ] && export RDEP_CUTLASS_TILES='//+epi///' || unset RDEP_CUTLASS_TILES
  $B/bin/rdep bench layer --ranks 1 --expert-compute cutlass --grads bf16 --json $OUT/layer_${n}_$t.json
done
# (the layer receipts here have their per-iteration arrays removed)
