# Session 35, call 5 (one H200, warm after call 4): cba3752 with a trial, not committed: GradAccumulateVec8Kernel taking two
# vectors of eight a thread an iteration (every load before the first store). Same time as call 4 (1.260 / 1.262 ms against
# 1.261 / 1.271): reverted.
CTEST_TIMEOUT=120 RDEP_COMMIT=cba3752+ilp2 bash scripts/device.sh --budget 300 --targets "optim_test capi_test rdep_capi" \
  --tests "GradAccumulate|CApiGradAccumulate" --pytest-k "move_is_torchs_add or fp32_grads" \
  --bench "bash -c 'PYTHONPATH=python RDEP_LIBRARY=build-dev/lib/librdep_capi.so python3 bench/optim_step.py --iters 20 --json \$OUT/optim_step.json 2>&1 | tail -5'"
