#!/usr/bin/env bash
# The rdep command as a user meets it: every case below runs the built binary and checks its exit code
# and a part of its output (stdout and stderr together). Sizes that would exhaust the machine must be
# refused by the estimate (exit 2, naming the flag) in well under a second; CTest runs this file as
# rdep_cli.exit_codes_and_messages:   bash tools/rdep/cli_exit_test.sh build/bin/rdep
set -uo pipefail
RDEP=${1:?usage: cli_exit_test.sh path/to/rdep}
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

# --- flags named in the message -------------------------------------------------------------------
expect 2 '--empty-rank must be a rank in \[0, W=4\), got -1' check --empty-rank -1
expect 2 '--empty-rank must be a rank in \[0, W=4\), got 4' check --empty-rank 4
expect 2 '--timeout must be' check --timeout nan

# --- output paths are opened before the work, with the OS's reason ---------------------------------
expect 2 '--json /nonexistent-dir/x.json: cannot open for writing: No such file or directory' \
  check --json /nonexistent-dir/x.json
expect 2 "--json $TMP: cannot open for writing: Is a directory" check --json "$TMP"

# --- numbers say what they are; a run writes its receipt -------------------------------------------
expect 0 'y normalized error [0-9.e-]+ \(max \|out-ref\| / .*passes <= 1\)' check --backend host --json "$TMP/c.json"
[ -s "$TMP/c.json" ] || { failures=$((failures + 1)); echo "FAIL: check --json wrote nothing"; }

echo "$cases cases, $failures failed"
[ "$failures" = 0 ]
