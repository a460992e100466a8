# device call (nvidia-h200), tree 1579c0a + bench/lab/kernel_trace.cc (first form: a name per line; the traces here are converted to the interned form)
RDEP_COMMIT=1579c0a+trace bash scripts/device.sh --targets rdep --tests NONE_XYZ --no-pytest --bench 'bash call1.sh' --budget 560
# call1.sh:
# Session 37, call 1: kernel timelines of rdep bench gemm (CUTLASS, bf16 grads) and of torch._grouped_mm under CUPTI.
set -x
CUPTI_LIB=$(dirname "$(find / -name 'libcupti.so*' -not -path '*/proc/*' 2>/dev/null | head -1)")
echo "cupti: $CUPTI_LIB"
g++ -O2 -std=c++17 -shared -fPIC -o /tmp/kernel_trace.so bench/lab/kernel_trace.cc -I/usr/local/cuda/include -L"$CUPTI_LIB" -lcupti -Wl,-rpath,"$CUPTI_LIB" || exit 1
mkdir -p $OUT/t
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 200 > $OUT/t/smi.csv 2>&1 &
SMI=$!
for mu in 128 384 1536; do
  RDEP_KERNEL_TRACE=$OUT/t/rdep_$mu.tsv LD_PRELOAD=/tmp/kernel_trace.so build-dev/bin/rdep bench gemm --mu $mu --path cutlass --grads bf16 --iters 40 --warmup 5 --json $OUT/t/gemm_$mu.json
  python3 bench/lab/kernel_trace_summary.py $OUT/t/rdep_$mu.tsv --json $OUT/t/sum_$mu.json
done
# the same without the tracer (does CUPTI change the times?)
build-dev/bin/rdep bench gemm --mu 128,384,1536 --path cutlass --grads bf16 --iters 40 --warmup 5
for mu in 384 1536; do
  RDEP_KERNEL_TRACE=$OUT/t/torch_$mu.tsv LD_PRELOAD=/tmp/kernel_trace.so python3 bench/torch_grouped_mm.py --counts-from $OUT/t/gemm_$mu.json --backward --iters 40 --warmup 5
done
kill $SMI
cd $OUT && tar czf t.tgz t && rm -r t
# Here, after the call: the traces (first tracer form, a name on every line) converted to the interned form
# (a name_id column and "#name" lines; a few lines of Python, names numbered in order of first appearance) and gzipped
# as trace_*.tsv.gz; the summaries regenerated with the current bench/lab/kernel_trace_summary.py:
#   python3 bench/lab/kernel_trace_summary.py <(gzip -dc trace_rdep_MU.tsv.gz) --skip 5 > trace_rdep_MU_summary.txt
#   python3 bench/lab/kernel_trace_summary.py <(gzip -dc trace_torch_MU.tsv.gz) --anchor silu_kernel --skip 5 > trace_torch_MU_summary.txt
