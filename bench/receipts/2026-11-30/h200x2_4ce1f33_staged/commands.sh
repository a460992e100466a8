#!/usr/bin/env bash
# Call 4 of the thirtieth session (2x H200, nvidia-h200-x2), tree 4ce1f33 plus the staged plan kernels (committed in
# 09be426 after this run, renamed and with the switches removed) and two temporary switches that existed only in the tested tree: RDEP_PLAN_V1 (call 3's fast path: a
# token's slots loaded straight into registers, the fault record after the scans) and RDEP_PLAN_GENERAL (the general
# path, i.e. the kernels before this session). Device call:
#   CTEST_TIMEOUT=120 bash scripts/device.sh --budget 540 --no-pytest --bench 'bash .ab.sh' \
#     --bench 'rdep check --backend cuda --ranks 2; rdep check --backend cuda --ranks 4' \
#     --bench 'env SANITIZE_TIMEOUT=40 SANITIZE_ONLY="^memcheck (dispatch|testing)" bash scripts/sanitize.sh memcheck' \
#     --bench 'python3 -m pytest python/tests -q (RDEP_REQUIRE_LIBRARY=1, the build's librdep_capi.so)'
# .ab.sh:
R=build-dev/bin/rdep
MS="--tokens 4096 --hidden 2048 --experts 64 --topk 6"
DS="--tokens 4096 --hidden 7168 --experts 256 --topk 8"
run() { local name=$1; shift; "$@" --json $OUT/ab_$name.json; }
for r in a b; do
  run w2_v2_$r $R bench dispatch --ranks 2 $MS --warmup 20 --iters 200
  run w2_v1_$r env RDEP_PLAN_V1=1 $R bench dispatch --ranks 2 $MS --warmup 20 --iters 200
  run w2_gen_$r env RDEP_PLAN_GENERAL=1 $R bench dispatch --ranks 2 $MS --warmup 20 --iters 200
  run w1_v2_$r $R bench dispatch --ranks 1 $MS --warmup 20 --iters 200
  run w1_v1_$r env RDEP_PLAN_V1=1 $R bench dispatch --ranks 1 $MS --warmup 20 --iters 200
  run w1_gen_$r env RDEP_PLAN_GENERAL=1 $R bench dispatch --ranks 1 $MS --warmup 20 --iters 200
done
run dsv3_w2_v2 $R bench dispatch --ranks 2 $DS --warmup 10 --iters 100
run dsv3_w2_gen env RDEP_PLAN_GENERAL=1 $R bench dispatch --ranks 2 $DS --warmup 10 --iters 100
for p in v2 v1; do  # ncu, W = 1
  e=""; [ $p = v1 ] && e="env RDEP_PLAN_V1=1"
  $e ncu --clock-control none -k regex:Window --metrics gpu__time_duration.sum,smsp__inst_executed.sum -c 4 $R bench dispatch --ranks 1 --no-nccl $MS --warmup 2 --iters 1
done
