#!/usr/bin/env bash
# Call 2 of the thirty-first session (one H200, nvidia-h200), tree 8ac03d7 plus the two labs (committed in 2ac9efc;
# initcheck_probe.cu then had two 256 KiB buffers, changed before call 3 to distinct sizes):
bash scripts/device.sh --no-pytest --tests NONE --targets "experts_test" \
  --bench 'nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/pdl bench/lab/pdl_chain.cu && /tmp/pdl 24576 16 20 && /tmp/pdl 24576 132 20 && /tmp/pdl 4194304 132 20' \
  --bench 'nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/icp bench/lab/initcheck_probe.cu -lcublasLt && /tmp/icp && compute-sanitizer --tool initcheck --print-limit 6 /tmp/icp' \
  --bench 'env SANITIZE_TIMEOUT=120 SANITIZE_ONLY="initcheck experts" bash scripts/sanitize.sh initcheck'
