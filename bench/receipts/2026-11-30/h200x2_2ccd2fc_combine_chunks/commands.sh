M="--tokens 4096 --hidden 2048 --experts 64 --topk 6 --warmup 20 --iters 200"
for c in 1 2 4 8; do RDEP_COMBINE_CHUNK=$c build-dev/src/dispatch/dispatch_test --gtest_filter='*CombineKernel*' 2>&1 | tail -1; done
for r in a b; do for c in 1 2 4 8; do
  echo "== chunk $c round $r"
  RDEP_COMBINE_CHUNK=$c build-dev/bin/rdep bench dispatch --ranks 2 $M --no-nccl --no-floor --json $OUT/c${c}_$r.json | grep "rdep phases"
  RDEP_COMBINE_CHUNK=$c build-dev/bin/rdep bench dispatch --ranks 2 $M --no-nccl --no-floor --owner-reduce --json $OUT/c${c}_or_$r.json | grep "rdep phases"
done; done
for c in 1 4 8; do echo "== dsv3 chunk $c"; RDEP_COMBINE_CHUNK=$c build-dev/bin/rdep bench dispatch --ranks 2 --tokens 4096 --hidden 7168 --experts 256 --topk 8 --warmup 20 --iters 100 --no-nccl --no-floor --json $OUT/c${c}_dsv3.json | grep "rdep phases"; done
for c in 1 4 8; do echo "== w1 H1024 chunk $c"; RDEP_COMBINE_CHUNK=$c build-dev/bin/rdep bench dispatch --ranks 1 --tokens 4096 --hidden 1024 --experts 64 --topk 6 --warmup 20 --iters 200 --no-nccl --no-floor --json $OUT/c${c}_w1.json | grep "rdep phases"; done
