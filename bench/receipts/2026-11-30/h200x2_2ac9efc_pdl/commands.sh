#!/usr/bin/env bash
# Call 3 of the thirty-first session (2x H200, nvidia-h200-x2), tree 2ac9efc (programmatic dependent launch):
CTEST_TIMEOUT=120 RDEP_COMMIT=2ac9efc bash scripts/device.sh --no-pytest --budget 565 --bench 'bash scripts/receipts_w4.sh pdl' \
  --bench 'nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/icp bench/lab/initcheck_probe.cu -lcublasLt && compute-sanitizer --tool initcheck --print-limit 10000000 /tmp/icp 2>&1 | grep -oE "of size [0-9,]+ bytes|at Read[A-Za-z]+|written as expected|checked values.*|every write.*" | sort | uniq -c' \
  --bench 'env SANITIZE_ONLY="dispatch_test" SANITIZE_TIMEOUT=60 bash scripts/sanitize.sh memcheck synccheck'
# receipts_w4.txt: the pdl stage's commands and summary lines; one JSON receipt per run.
