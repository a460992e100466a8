# device call (nvidia-h200), tree cfda6be: issue 14's whole-layer targets at W = 1 (baseline in the same call), CUDA graph, rdep check
RDEP_COMMIT=cfda6be bash scripts/device.sh --targets rdep --tests NONE_XYZ --no-pytest --no-eager-ext --bench 'bash call5.sh' --budget 380
# call5.sh:
# Session 37, call 5: issue 14's whole-layer targets on the final tree (W = 1, Moonlight, baseline in the same call), eager and
# CUDA-graph timings, and rdep check at W = 1.
set -x
mkdir -p $OUT/r
torchrun --nproc-per-node=1 shared/baselines/torch_ep_moe.py --json $OUT/r/torch_w1.json
build-dev/bin/rdep bench layer --ranks 1 --expert-compute cutlass --grads bf16 --graph --json $OUT/r/layer_w1_bf16.json --baseline-json $OUT/r/torch_w1.json
build-dev/bin/rdep check --backend cuda --ranks 1 --expert-compute cutlass --json $OUT/r/check_w1.json
cd $OUT && tar czf r.tgz r && rm -r r
