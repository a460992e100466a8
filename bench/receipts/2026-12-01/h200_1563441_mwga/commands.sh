# Session 34, call 6 (one H200, warm after call 5): tree 1563441.
RDEP_COMMIT=1563441 bash scripts/device.sh --targets "rdep_capi" --tests NoSuchTestXYZ --no-pytest --bench 'env GA_STEPS=60 bash scripts/receipts_w4.sh trainmwga' --budget 500
