# Session 34, call 1 (one H200): tree 403ed48 plus bench/lab/lt_grouped_gemm.cc (the lab's first version).
RDEP_COMMIT=403ed48+ltlab bash scripts/device.sh --targets "optim_test capi_test capi_cuda_test rdep_capi rdep lt_grouped_gemm" \
  --tests "MasterAdamW|CApi|Optim" --pytest-k "optim or capi" --bench 'bash call1.sh' \
  --bench "bash -c 'PYTHONPATH=python RDEP_LIBRARY=build-dev/lib/librdep_capi.so timeout 150 python3 -m pytest -q -p no:cacheprovider examples/torch_training/test_train.py -k \"master or expert_weights or clip\" 2>&1 | tail -4'"
# call1.sh: pip show nvidia-cublas; find libcublasLt; then
#   build-dev/bench/lab/lt_grouped_gemm --roles g1,g2 --mu 384,1536 --iters 20 --warmup 5 --rounds 1 --algos 4
#   LD_PRELOAD=<site-packages>/nvidia/cu13/lib/libcublasLt.so.13 build-dev/bench/lab/lt_grouped_gemm --mu 128,384,768,1536,3072 --iters 30 --warmup 5 --rounds 2 --algos 6
