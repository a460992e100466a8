#!/usr/bin/env bash
# Call 1 of the thirty-first session (2x H200, nvidia-h200-x2), tree 8ac03d7 (the thirtieth session's committed plan kernels):
CTEST_TIMEOUT=120 RDEP_COMMIT=8ac03d7 bash scripts/device.sh --no-pytest --tests 'WindowPlan|CudaValidation|CudaSourceWindows|Window' \
  --bench 'env SANITIZE_TIMEOUT=90 SANITIZE_ONLY="dispatch_test|router_kernel_test|experts_test" bash scripts/sanitize.sh racecheck synccheck initcheck' \
  --bench 'build-dev/bin/rdep check --backend cuda --ranks 4' --bench 'build-dev/bin/rdep check --backend cuda --ranks 1'
