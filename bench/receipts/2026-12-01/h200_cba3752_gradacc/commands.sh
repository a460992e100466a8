# Session 35, call 4 (one H200): tree cba3752 (rdep_grad_accumulate, C ABI 23; the prebuilt descriptors after the review).
CTEST_TIMEOUT=120 RDEP_COMMIT=cba3752 bash scripts/device.sh --budget 540 --targets "optim_test capi_test capi_cuda_test rdep_capi experts_test group_maps_ab" \
  --tests "GradAccumulate|MasterAdamW|CApi|GroupedGemmSm90|CutlassExpertCompute" --pytest-k "optim or capi" \
  --bench "bash -c 'PYTHONPATH=python RDEP_LIBRARY=build-dev/lib/librdep_capi.so python3 bench/optim_step.py --iters 20 --json \$OUT/optim_step.json 2>&1 | tail -14'" \
  --bench "bash -c 'timeout 60 build-dev/bench/lab/group_maps_ab --mu 128,1536 --rounds 1 --iters 20 --warmup 5 2>&1 | tail -14'"
