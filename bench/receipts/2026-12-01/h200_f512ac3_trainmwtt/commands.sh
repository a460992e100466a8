# call 5 (nvidia-h200, fresh machine): the kernel tests, then the stage, which stopped at once (receipts_w4.sh needs
# build-dev/bin/rdep, not built with --targets "rdep_capi optim_test"):
CTEST_TIMEOUT=60 RDEP_COMMIT=f512ac3 bash scripts/device.sh --budget 280 --targets "rdep_capi optim_test" --tests "MasterAdamWCuda" --no-pytest --bench "bash scripts/receipts_w4.sh trainmwtt"
# call 6 (the same machine, warm): the stage's two runs by hand. rdep's run wrote its receipt (200 steps) and was then
# cut by the 85 s timeout during its teardown (rc 124).
bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD/python RDEP_LIBRARY=$PWD/build-dev/lib/librdep_capi.so PYTHONUNBUFFERED=1; for v in "torchtitan --baseline-expert-weights bf16-master:tt" "rdep --expert-weights bf16-master:rdep"; do name=${v##*:}; args=${v%:*}; timeout 85 python3 examples/torch_training/train.py --device cuda --moe $args --compile-mode reduce-overhead --json $OUT/train_w1_mwtt_$name.json > $OUT/train_w1_mwtt_$name.log 2>&1; echo "$name rc=$?"; tail -2 $OUT/train_w1_mwtt_$name.log; done'
