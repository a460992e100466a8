#!/usr/bin/env bash
# The rdep command as a user meets it: every case below runs the built binary and checks its exit code
# and a part of its output (stdout and stderr together). Sizes that would exhaust the machine must be
# refused by the estimate (exit 2, naming the flag) in well under a second; CTest runs this file as
# rdep_cli.exit_codes_and_messages:   bash tools/rdep/cli_exit_test.sh build/bin/rdep ON|OFF (RDEP_HAVE_CUDA)
set -uo pipefail
RDEP=${1:?usage: cli_exit_test.sh path/to/rdep [ON|OFF: the build has the CUDA backend]}
HAVE_CUDA=${2:?usage: cli_exit_test.sh path/to/rdep ON|OFF (the build has the CUDA backend)}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failures=0
cases=0

# expect CODE REGEX ARGS...: `rdep ARGS` exits CODE and its output matches the extended regex REGEX.
expect() {
  local code=$1 regex=$2
  shift 2
  cases=$((cases + 1))
  local out rc
  out=$(timeout 60 "$RDEP" "$@" 2>&1)
  rc=$?
  if [ "$rc" != "$code" ] || ! grep -Eq -- "$regex" <<<"$out"; then
    failures=$((failures + 1))
    echo "FAIL: rdep $* -> exit $rc (want $code), output should match /$regex/:"
    head -c 2000 <<<"$out" | sed 's/^/    /'
  fi
}
# first_line REGEX ARGS...: the first line of `rdep ARGS` (exit 0) matches REGEX.
first_line() {
  local regex=$1
  shift
  cases=$((cases + 1))
  local out rc
  out=$(timeout 60 "$RDEP" "$@" 2>&1)
  rc=$?
  if [ "$rc" != 0 ] || ! head -n 1 <<<"$out" | grep -Eq -- "$regex"; then
    failures=$((failures + 1))
    echo "FAIL: rdep $* -> exit $rc, first line should match /$regex/:"
    head -n 3 <<<"$out" | sed 's/^/    /'
  fi
}

# expect_not CODE REGEX ARGS...: `rdep ARGS` exits CODE and its output does NOT match REGEX.
expect_not() {
  local code=$1 regex=$2
  shift 2
  cases=$((cases + 1))
  local out rc
  out=$(timeout 60 "$RDEP" "$@" 2>&1)
  rc=$?
  if [ "$rc" != "$code" ] || grep -Eq -- "$regex" <<<"$out"; then
    failures=$((failures + 1))
    echo "FAIL: rdep $* -> exit $rc (want $code), output should not match /$regex/:"
    grep -E -m 3 -- "$regex" <<<"$out" | sed 's/^/    /'
  fi
}

# --- oversized shapes: refused by the estimate, naming the flags and the estimate -------------------
expect 2 'host memory.*--experts 1024 x --hidden 65536 x --ffn 65536' \
  check --backend host --tokens 4096 --hidden 65536 --ffn 65536 --experts 1024 --topk 8
expect 2 'host memory.*--tokens 2147483648' check --backend host --tokens 2147483648
expect 2 'host memory.*--ffn 99999999' check --backend host --hidden 64 --ffn 99999999 --tokens 4
expect 2 'host memory.*--experts 2147483647' check --backend host --experts 2147483647 --topk 1 --tokens 4
expect 2 'host memory.*--tokens 1000000' check --backend host --tokens 1000000 --hidden 1000000
expect 2 'host memory.*--tokens 2147483647' check --backend host --tokens 2147483647 --hidden 8 --ranks 1 --experts 1 --topk 1
expect 2 'more than the limit of 1.00 MiB \(--max-memory-gib' check --backend host --max-memory-gib 0.0009765625
RDEP_MAX_MEMORY_GIB=0.0009765625 expect 2 'RDEP_MAX_MEMORY_GIB' check --backend host
expect 2 'operations.*--max-gop' check --backend host --max-gop 0.001
expect 2 '--max-memory-gib must be a finite number > 0' check --max-memory-gib -1
expect 2 'the host backend runs at most 4096 ranks' check --backend host --ranks 5000

# (a machine with more memory than this one may refuse by the work estimate first; either names the flags)
expect 2 '(host memory|operations).*--ranks 8 x --tokens 100000000' route --tokens 100000000 --experts 1000
expect 2 'operations.*--max-gop' route --max-gop 0.000001
expect 2 'host memory.*--ranks 2000000000 x --experts 2000000000' plan sim --experts 2000000000 --ranks 2000000000 --slots 1
expect 2 'host memory' plan record --experts 100000 --ranks 1000000 --out "$TMP/never.trace"
expect 2 'host memory' plan show --experts 2000000000 --ranks 2000000000 --slots 0 --topk 1
expect 2 'host memory' plan bench --device host --experts 2000000000 --ranks 2000000000
# A trace whose header asks for 2e9 x 2e9 loads is refused from its header, before reading the steps.
printf 'rdep-load-trace v1 experts=2000000000 ranks=2000000000 steps=2\nstep 0\n1\n' >"$TMP/huge.trace"
expect 2 "--trace $TMP/huge.trace: .*host memory.*trace ranks 2000000000 x trace experts 2000000000" \
  plan sim --trace "$TMP/huge.trace" --slots 1
printf 'rdep-load-trace v1 experts=4 ranks=1 steps=1\nstep 0\n1,2,3,4\nstep 1\n1,2,3,4\n' >"$TMP/long.trace"
expect 2 "more steps than the header's 1" plan sim --trace "$TMP/long.trace" --slots 1
printf 'rdep-load-trace v1 experts=4000000000 ranks=1 steps=1\n' >"$TMP/wide.trace"
expect 2 'must fit in int32' plan sim --trace "$TMP/wide.trace" --slots 1

# --- flags named in the message -------------------------------------------------------------------
expect 2 '--empty-rank must be a rank in \[0, W=4\), got -1' check --empty-rank -1
expect 2 '--empty-rank must be a rank in \[0, W=4\), got 4' check --empty-rank 4
expect 2 '--timeout must be' check --timeout nan
expect 2 "--balance: balancer 'greedy' is not one of off, ultraep, eplb, eplb-exact" check --backend host --balance greedy
expect 2 '--slots needs --balance' check --backend host --slots 3
expect 2 '--slots must be in \[0, E=16\], got 17' check --backend host --balance ultraep --slots 17
expect 2 '--min-quota must be >= 1, got 0' check --backend host --balance ultraep --min-quota 0
expect 2 '--relay-above must be in \[0, 1000000\], got -1' check --backend host --balance ultraep --relay-above -1
expect 2 '--relay-above needs --balance' check --backend host --relay-above 2
expect 2 '--relay-above must be in \[0, 1000000\], got -1' check --backend cuda --balance ultraep --relay-above -1  # relays run on both backends
expect 2 '--nodes must divide --ranks W=4 \(N nodes x G ranks per node = W\), got 3' check --backend host --nodes 3
expect 2 '--max-nodes must be in \[1, N=2\], got 3' check --backend host --nodes 2 --max-nodes 3
expect 2 '--nodes with --expert-compute cutlass' check --backend cuda --nodes 2 --expert-compute cutlass
expect 2 '--owner-reduce with --nodes' check --backend host --nodes 2 --owner-reduce
expect 2 "--stash-rows is the CUDA layer's paged stash" check --backend host --stash-rows 4096
expect 0 'S=auto owner-reduce, routing zipf:1' check --backend host --owner-reduce --routing zipf:1 --capacity-factor 0.8
expect 0 'y, dx within .*dgate bitwise equal to balancing off' check --backend host --owner-reduce --balance ultraep --routing zipf:2
expect 2 'K=4 experts do not fit on M=1 nodes' check --backend host --ranks 4 --experts 4 --nodes 4 --max-nodes 1
# bench dispatch --nodes: the two-phase exchange on the host backend (CI); bad node splits name the flag.
expect 2 '--nodes must divide --ranks W=8 .*got 3' bench dispatch --backend host --ranks 8 --nodes 3
expect 2 '--nodes must divide --ranks W=8 .*got 1' bench dispatch --backend host --ranks 8 --nodes 1
expect 2 '--max-nodes must be in \[1, N=4\], got 5' bench dispatch --backend host --ranks 8 --nodes 4 --max-nodes 5
expect 2 '--max-nodes must be in \[1, N=4\], got 0' bench dispatch --backend host --ranks 8 --nodes 4 --max-nodes 0
expect 2 '--no-nccl belongs to the one-domain form' bench dispatch --backend host --ranks 8 --nodes 4 --no-nccl
expect 2 '--owner-reduce belongs to the one-domain form' bench dispatch --backend host --ranks 8 --nodes 4 --owner-reduce
expect 2 '--gpus needs --backend cuda' bench dispatch --backend host --ranks 8 --nodes 4 --gpus 1
expect 2 'unknown flag --bogus' bench dispatch --backend host --ranks 8 --nodes 4 --bogus 1
expect 2 '--json' bench dispatch --backend host --ranks 8 --nodes 4 --json /nonexistent-dir/x.json
expect 0 'traffic = rdep model: every iteration' bench dispatch --backend host --ranks 8 --experts 32 --topk 4 --nodes 4 \
  --max-nodes 2 --tokens 32 --hidden 16 --warmup 1 --iters 3 --routing zipf:1.2 --capacity-factor 0.9 --json "$TMP/nodes.json"
expect 0 'inter-node combine' bench dispatch --backend host --ranks 4 --nodes 2 --tokens 16 --hidden 16 --experts 8 --topk 2 \
  --iters 2 --json "$TMP/nodes2.json"
cases=$((cases + 1))
if ! grep -Eq '"traffic_equals_model": ?true' "$TMP/nodes2.json" || ! grep -q '"model_bytes"' "$TMP/nodes2.json"; then
  failures=$((failures + 1))
  echo "FAIL: the bench dispatch --nodes receipt lacks traffic_equals_model true and the model's bytes"
fi
# bench dispatch (one domain) with ranks sharing GPUs (--gpus G < W): on a GPU machine it runs, says its times are not
# NVLink's and skips the NCCL baseline (NCCL takes one rank a GPU); without a GPU it is refused.
if [ "$HAVE_CUDA" = ON ] && [ "${CUDA_VISIBLE_DEVICES-unset}" != "" ] && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  expect 0 'nccl baseline: skipped \(ranks share GPUs' bench dispatch --ranks 2 --gpus 1 --tokens 256 --hidden 256 --experts 8 \
    --topk 2 --warmup 2 --iters 5 --json "$TMP/shared.json"
  cases=$((cases + 1))
  if ! grep -Eq '"ranks_share_gpus": ?true' "$TMP/shared.json"; then
    failures=$((failures + 1))
    echo "FAIL: the bench dispatch --gpus 1 receipt lacks ranks_share_gpus true"
  fi
  expect 2 '--gpus must be in \[1, min\(--ranks, GPUs\)\] = \[1, [0-9]+\] on this machine, got 99' bench dispatch --ranks 2 --gpus 99
  expect 2 '--ranks must be in \[1, 1024\], got 0' bench dispatch --ranks 0
elif [ "$HAVE_CUDA" = ON ]; then
  expect 2 'no CUDA device is present' bench dispatch --ranks 2 --gpus 1
else
  expect 2 'no CUDA backend' bench dispatch --ranks 2 --gpus 1
fi
expect 2 '--skew must be a finite number, got nan' route --routing router --skew nan
expect 2 '--alpha: each power-law exponent must be a finite number >= 0, got -1' plan sim --alpha -1
expect 2 '--alpha must be a finite number >= 0' plan show --alpha nan
expect 2 '--steps must be in \[2, 1000000\], got 4294967298' plan sim --steps 4294967298
expect 2 '--slots must be in' plan bench --device host --slots -1
expect 2 'count 0 is above 2\^40 rows' model padding --counts 9223372036854775807,1
expect 2 'topk \(70\) is larger than experts \(64\)' model transport --topk 70
expect 2 "--expert-compute: expert compute: 'foo' is not cublaslt or cutlass" check --expert-compute foo
expect 2 "--expert-compute chooses the CUDA backend's expert compute" check --backend host --expert-compute cutlass
expect 0 'dispatch bytes / rank +42.1 MB .*floor 109.1 us' model transport
expect 2 "unknown command 'nosuch'" nosuch
expect 2 "unknown subcommand 'nosuch'" plan nosuch

# --- output paths are opened before the work, with the OS's reason ---------------------------------
expect 2 '--json /nonexistent-dir/x.json: cannot open for writing: No such file or directory' \
  check --json /nonexistent-dir/x.json
expect 2 "--json $TMP: cannot open for writing: Is a directory" check --json "$TMP"
expect 2 '--out /nonexistent-dir/t.trace: cannot open for writing: No such file or directory' \
  plan record --experts 8 --ranks 2 --tokens 4 --out /nonexistent-dir/t.trace
expect 2 '--json /nonexistent-dir/s.json: cannot open for writing' plan sim --experts 8 --ranks 2 --slots 1 --steps 2 --json /nonexistent-dir/s.json
expect 2 '--png /nonexistent-dir/s.png: cannot open for writing' plan sim --experts 8 --ranks 2 --slots 1 --steps 2 --png /nonexistent-dir/s.png
expect 2 '--json /nonexistent-dir/b.json: cannot open for writing' plan bench --device host --iters 1 --json /nonexistent-dir/b.json
[ ! -e "$TMP/never.trace" ] || { failures=$((failures + 1)); echo "FAIL: a refused plan record left its --out file"; }

# --- help: one convention, every page starts with its usage line, sources named by title ----------
for args in "-h" "--help" "help" "check -h" "check --help" "help check" "route -h" "route --help" "help route" \
            "model -h" "model --help" "help model" "model pooling -h" "help model barrier" "model cross-node --help" "model transport -h" \
            "plan -h" "plan --help" "help plan" "plan sim -h" "plan sim --help" "help plan sim" "plan record --help" \
            "plan bench -h" "plan show --help" "bench -h" "bench --help" "help bench" "bench layer --help" \
            "bench layer -h" "help bench layer" "bench dispatch --help" "bench gemm -h" "bench barrier --help"; do
  # shellcheck disable=SC2086
  first_line '^usage: rdep' $args
  # shellcheck disable=SC2086
  expect_not 0 'seeds 00[0-9] (Table|eq|section)' $args
done
expect 0 'the RDEP paper \(seeds 000\), Table 18' help check
# bench gemm's flags are checked before any device is looked for (a build without CUDA refuses first)
expect 2 "(--grads must be fp32 or bf16, got 'fp16'|built without CUDA)" bench gemm --grads fp16
expect 2 "(--path fused \(the SwiGLU in GEMM1's epilogue\) needs --gate-up interleaved8|built without CUDA)" bench gemm --path cutlass-fused
expect 2 "(--gate-up must be split or interleaved8, got 'halves'|built without CUDA)" bench gemm --gate-up halves
expect_not 0 'usage: rdep plan (record|bench|show)' plan sim --help
expect 0 'usage: rdep plan sim' plan sim --trace x --help
expect 2 '^usage: rdep plan <sim' plan
expect 0 'us/barrier' bench barrier --ranks 4,16 --iters 5 --warmup 1

# --- numbers say what they are; a run writes its receipt -------------------------------------------
expect 0 'y normalized error [0-9.e-]+ \(max \|out-ref\| / .*passes <= 1\)' check --backend host --json "$TMP/c.json"
[ -s "$TMP/c.json" ] || { failures=$((failures + 1)); echo "FAIL: check --json wrote nothing"; }
expect 0 'gradient parity .*normalized error dx [0-9.e-]+.*\(passes <= 1\)' check --backend host
# A run whose barriers all time out fails its checks and prints no made-up summary (no "0.000 MiB (S=0)").
expect 1 '[1-6] failed' check --backend host --ranks 64 --timeout 1e-9
expect_not 1 'symmetric buffers per rank: 0.000 MiB' check --backend host --ranks 64 --timeout 1e-9
expect 1 '[1-6] failed' check --backend host --ranks 64 --timeout 1e-9 --json "$TMP/failed.json"
grep -Eq '"symmetric_bytes_per_rank": *null' "$TMP/failed.json" || grep -Eq '"segments": *[1-9]' "$TMP/failed.json" ||
  { failures=$((failures + 1)); echo "FAIL: the receipt of a failed run reports unmeasured sizes as numbers"; }

echo "$cases cases, $failures failed"
[ "$failures" = 0 ]
