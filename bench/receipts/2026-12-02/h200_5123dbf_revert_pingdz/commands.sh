# Session 36, call 3 (one H200), tree 5123dbf with the epilogue reverted (the next commit): dz's tile A/B, torch._grouped_mm in the same call
CTEST_TIMEOUT=120 RDEP_COMMIT=5123dbf-reverted bash scripts/device.sh --budget 560 --targets "rdep experts_test" --tests "CutlassExpertCompute|GroupedGemmSm90|CutlassSwigluEpilogue|CutlassGate|ExpertMlp|ExpertCompute" --no-pytest --bench 'bash call3.sh'
# call3.sh:
B=build-dev
P='cutlass,cutlass://ping_128x128///,cutlass,cutlass://ping_128x128///'
echo "== rdep bench gemm"
timeout 150 $B/bin/rdep bench gemm --experts 16 --hidden 2048 --ffn 1408 --mu 128,384,768,1536,3072 --path "$P" \
  --grads bf16 --iters 100 --warmup 10 --json $OUT/gemm.json | grep -vE "^(rows%|L2)"
echo "== torch._grouped_mm on the same counts"
timeout 100 python3 bench/torch_grouped_mm.py --counts-from $OUT/gemm.json --backward --iters 100 --warmup 10 --json $OUT/torch.json
n=0
for t in default ping default ping; do
  n=$((n + 1))
  echo "== rdep bench layer W=1, dz $t"
  [ $t = ping ] && export RDEP_CUTLASS_TILES='//ping_128x128///' || unset RDEP_CUTLASS_TILES
  timeout 60 $B/bin/rdep bench layer --ranks 1 --expert-compute cutlass --grads bf16 --json $OUT/layer_${n}_$t.json 2>&1 | grep -E "^  forward|forward\+backward  "
done
# (layer receipts without their per-iteration arrays)
