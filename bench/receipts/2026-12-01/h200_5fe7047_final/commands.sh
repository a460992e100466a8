# Session 35, call 3 (one H200): tree 5fe7047 (prebuilt TMA descriptors the default): every ctest test, pytest -k "moe or graph",
# two rdep bench gemm runs, then torch._grouped_mm on the second run's counts (its own process, after rdep's).
CTEST_TIMEOUT=120 RDEP_COMMIT=5fe7047 bash scripts/device.sh --budget 560 --pytest-k "moe or graph" --bench 'bash -c "for i in 1 2; do \
  build-dev/bin/rdep bench gemm --experts 16 --hidden 2048 --ffn 1408 --mu 128,384,768,1536,3072 --path cutlass --grads bf16 \
  --iters 100 --warmup 10 --json \$OUT/gemm_\$i.json; done; python3 bench/torch_grouped_mm.py --counts-from \$OUT/gemm_2.json \
  --backward --iters 100 --warmup 10 --json \$OUT/torch.json"'
