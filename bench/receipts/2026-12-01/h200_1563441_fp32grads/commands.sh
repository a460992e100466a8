# Session 34, call 5 (one H200): tree 1563441 (MasterAdamW fp32_grads, C ABI 22).
RDEP_COMMIT=1563441 bash scripts/device.sh --targets "optim_test capi_test capi_cuda_test rdep_capi" --tests "MasterAdamW|CApi" \
  --pytest-k "optim or capi" \
  --bench "bash -c 'PYTHONPATH=python RDEP_LIBRARY=build-dev/lib/librdep_capi.so timeout 200 python3 -m pytest -q -p no:cacheprovider examples/torch_training/test_train.py -k \"master or expert_weights or clip or grad_accum\" 2>&1 | tail -4'" \
  --bench "bash -c 'PYTHONPATH=python RDEP_LIBRARY=build-dev/lib/librdep_capi.so python3 bench/optim_step.py --iters 20 --json \$OUT/optim_step.json 2>&1 | tail -12'"
