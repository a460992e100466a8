# device call (nvidia-h200), tree 1579c0a + the tracer (interned names)
RDEP_COMMIT=1579c0a+trace2 bash scripts/device.sh --targets rdep --tests NONE_XYZ --no-pytest --bench 'bash call2.sh' --budget 560
# call2.sh:
# Session 37, call 2: 2x1 clusters (TMA multicast of the weight tile) on the coop_128x256 GEMMs against the default, alternated,
# under the protocol (20 + 200) and sustained (200 + 600 at mu = 1536); per-kernel traces; torch._grouped_mm after, same counts.
set -x
CUPTI_LIB=$(dirname "$(find /usr/local/cuda*/ -name 'libcupti.so*' 2>/dev/null | head -1)")
g++ -O2 -std=c++17 -shared -fPIC -o /tmp/kernel_trace.so bench/lab/kernel_trace.cc -I/usr/local/cuda/include -L"$CUPTI_LIB" -lcupti -Wl,-rpath,"$CUPTI_LIB" || exit 1
mkdir -p $OUT/t
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw.instant,temperature.gpu,clocks_event_reasons.active --format=csv -lms 100 > $OUT/t/smi.csv 2>&1 &
SMI=$!
C2=coop_128x256_c2x1
P="cutlass,cutlass:$C2/$C2//$C2/$C2/,cutlass,cutlass:$C2/$C2//$C2/$C2/"
RDEP_KERNEL_TRACE=$OUT/t/ab.tsv LD_PRELOAD=/tmp/kernel_trace.so build-dev/bin/rdep bench gemm --mu 128,384,768,1536,3072 --path "$P" --grads bf16 --json $OUT/t/ab.json
python3 bench/lab/kernel_trace_summary.py $OUT/t/ab.tsv --skip 20 --json $OUT/t/ab_sum.json > $OUT/t/ab_sum.txt
RDEP_KERNEL_TRACE=$OUT/t/long.tsv LD_PRELOAD=/tmp/kernel_trace.so build-dev/bin/rdep bench gemm --mu 1536 --path "$P" --grads bf16 --warmup 200 --iters 600 --json $OUT/t/long.json
python3 bench/lab/kernel_trace_summary.py $OUT/t/long.tsv --skip 200 --json $OUT/t/long_sum.json > $OUT/t/long_sum.txt
python3 bench/torch_grouped_mm.py --counts-from $OUT/t/ab.json --backward --json $OUT/t/torch_ab.json
RDEP_KERNEL_TRACE=$OUT/t/torch_long.tsv LD_PRELOAD=/tmp/kernel_trace.so python3 bench/torch_grouped_mm.py --counts-from $OUT/t/long.json --backward --warmup 200 --iters 600 --json $OUT/t/torch_long.json
kill $SMI
grep -A3 "^[0-9]* kernels an iteration" $OUT/t/long_sum.txt | head -40
cd $OUT && tar czf t.tgz t && rm -r t
# ab_sum.txt and long_sum.txt were written on the device by the first version of kernel_trace_summary.py (gaps against
# the previous kernel's end, "gaps" a sum of medians); their traces (ab.tsv 6.3 MB, long.tsv 4.6 MB) are not committed.
# trace_torch_long.tsv.gz is committed; its summary was regenerated here with the current script:
#   python3 bench/lab/kernel_trace_summary.py <(gzip -dc trace_torch_long.tsv.gz) --anchor silu_kernel --skip 200 > trace_torch_long_summary.txt
# The clocks per window in docs/perf-notes.md: smi.csv's samples between each run's first start and last end in the traces
# (both wall-clock; "loaded" = power.draw.instant above 300 W).
