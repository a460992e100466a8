#!/usr/bin/env bash
# Call 3 of the thirtieth session (2x H200), tree f7df0e9 with the fast kernel 1 templated on 8 or 16 slots and two
# temporary switches that existed only in that tree: RDEP_PLAN_SLOTS16 (16 slots at K = 6) and RDEP_PLAN_GENERAL (the
# general path, the kernels before this session). Per round a, b: rdep bench dispatch --ranks 2 and --ranks 1 at the
# Moonlight shape (--tokens 4096 --hidden 2048 --experts 64 --topk 6 --warmup 20 --iters 200) for fast8 (default),
# fast16 and gen; DeepSeek-V3's shape (--hidden 7168 --experts 256 --topk 8 --warmup 10 --iters 100) at W = 2 for fast8
# and gen; then ncu (--clock-control none) on the Window kernels at W = 1 with --section WarpStateStats InstructionStats
# LaunchStats SourceCounters (ncu_fast8.txt). sanitize_one_gpu.txt: CUDA_VISIBLE_DEVICES=0 scripts/sanitize.sh memcheck.
# sanitize.txt: memcheck of the validation matrix on two GPUs, whose 324 "errors" were CUDA API errors
# (cudaErrorPeerAccessAlreadyEnabled, tolerated by CudaDomain), not memory accesses; sanitize.sh no longer reports them.
