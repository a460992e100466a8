# device call (nvidia-h200), tree 7ab7b3f: issue 14 item 5, the whole expert-compute sweep (E_loc 16 64 32 8, five routings, mu 128..6144, 5 warmup + 30 iters, bf16 gradients), torch._grouped_mm on each receipt's counts
RDEP_COMMIT=7ab7b3f ELOC="16 64 32 8" bash scripts/device.sh --targets rdep --tests NONE_XYZ --no-pytest --bench 'bash scripts/sweep_gemm.sh' --budget 575
# Here, after the call: the table again with the current bench/summarize_gemm_sweep.py (ratios cut, not rounded, to three
# decimals; the gradients and iterations said above it), from the receipts in sweep_gemm.tgz:
#   mkdir /tmp/sw && tar xzf sweep_gemm.tgz -C /tmp/sw && python3 bench/summarize_gemm_sweep.py /tmp/sw > sweep_gemm_cut.md
