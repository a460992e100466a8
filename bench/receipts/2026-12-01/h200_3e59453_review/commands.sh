# Session 34, call 7 (one H200): tree 3e59453 (MasterAdamW fp32_grads after the review; the labs on gemm_lab.h).
RDEP_COMMIT=3e59453 bash scripts/device.sh --targets "optim_test capi_test rdep_capi grouped_gemm_tiles lt_grouped_gemm" \
  --tests "MasterAdamW|CApiMasterAdamW" --pytest-k "optim" \
  --bench "bash -c 'PYTHONPATH=python RDEP_LIBRARY=build-dev/lib/librdep_capi.so timeout 200 python3 -m pytest -q -p no:cacheprovider examples/torch_training/test_train.py -k \"master or expert_weights or clip or grad_accum\" 2>&1 | tail -4'" \
  --bench 'build-dev/bench/lab/grouped_gemm_tiles --mu 1536 --roles g1,dw1 --tiles coop_128x256,ping_128x128_c2x1 --iters 20 --warmup 5' \
  --bench 'build-dev/bench/lab/lt_grouped_gemm --mu 384,1536 --roles g1,dw2 --iters 20 --warmup 5 --rounds 1' --budget 420
