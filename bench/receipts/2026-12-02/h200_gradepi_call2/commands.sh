# Session 36, call 2 (one H200), tree 8a6bc3f + dz's SwiGLU' epilogue with the load warp's L2 prefetch of h (commit 2):
CTEST_TIMEOUT=120 RDEP_COMMIT=8a6bc3f+gradepi2 bash scripts/device.sh --budget 560 --targets "rdep experts_test" --tests "CutlassSwigluGradEpilogue|ExpertCompute_TileSpec|CutlassSwigluEpilogue" --no-pytest --bench 'bash call2.sh'
# call2.sh:
B=build-dev
P='cutlass,cutlass://ping_128x128///,cutlass://ping_128x128+epi///,cutlass://+epi///'
for i in 1 2; do
  for pf in 1 0; do
    echo "== rdep bench gemm, round $i, RDEP_SWIGLU_GRAD_PREFETCH=$pf"
    RDEP_SWIGLU_GRAD_PREFETCH=$pf timeout 100 $B/bin/rdep bench gemm --experts 16 --hidden 2048 --ffn 1408 --mu 128,384,768,1536,3072 \
      --path "$P" --grads bf16 --iters 50 --warmup 10 --json $OUT/gemm_${i}_pf$pf.json | grep -vE "^(rows%|L2)"
  done
done
