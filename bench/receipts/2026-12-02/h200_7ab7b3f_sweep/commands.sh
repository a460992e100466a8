# device call (nvidia-h200), tree 7ab7b3f: issue 14 item 5, the whole expert-compute sweep (E_loc 16 64 32 8, five routings, mu 128..6144, 5 warmup + 30 iters, bf16 gradients), torch._grouped_mm on each receipt's counts
RDEP_COMMIT=7ab7b3f ELOC="16 64 32 8" bash scripts/device.sh --targets rdep --tests NONE_XYZ --no-pytest --bench 'bash scripts/sweep_gemm.sh' --budget 575
