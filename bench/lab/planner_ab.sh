#!/usr/bin/env bash
# Lab (GPU planner, docs/perf-notes.md): A/B of the GPU solve time in one device call. Builds each
# version given (default HEAD) in its own worktree: a git ref, or a FILE.patch applied on HEAD (the
# device's copy of the repository may lack local commits: patches travel with the tree); builds the
# working tree in build-dev; then alternates `rdep plan bench --device gpu` at the bench shape over
# all of them ROUNDS times (default 3), so that machine drift hits every version alike.
# FINE=1 also builds the working tree with -DRDEP_GPU_PLANNER_FINE_STAMPS and prints its phase cycles.
#   bash bench/lab/planner_ab.sh [REF...]      (from the repository root)
set -uo pipefail
[ $# -eq 0 ] && set -- HEAD
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
jobs=$(nproc)
log() { echo "$OUT/ab-$(echo "$1" | tr '/.' '__').log"; }
build() {  # build SRC DIR TARGET [cmake args...]
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release "${@:4}" >"$(log "$2")" 2>&1 &&
    cmake --build "$2" -j "$jobs" --target "$3" >>"$(log "$2")" 2>&1 ||
    { echo "build of $1 in $2 failed"; grep -E "error" "$(log "$2")" | head -10; return 1; }
}
names=() srcs=()
git worktree prune
n=0
for ref in "$@"; do
  n=$((n + 1))
  wt=/tmp/rdep-ab-$n-$(basename "$ref" | tr '/~^.' '____')
  rm -rf "$wt"; git worktree prune
  if [ -f "$ref" ]; then
    git worktree add -q --detach "$wt" HEAD && git -C "$wt" apply "$(realpath "$ref")" || exit 1
  else
    git worktree add -q --detach "$wt" "$ref" || exit 1
  fi
  build "$wt" "$wt/b" rdep || exit 1
  names+=("$ref@$(git -C "$wt" rev-parse --short HEAD)") srcs+=("$wt")
done
build . build-dev rdep || exit 1  # the working tree's own build, current
names+=("working-tree") srcs+=(".")
args=(plan bench --device gpu --experts 256 --ranks 64 --slots 2)
for _ in $(seq "$ROUNDS"); do
  for i in "${!srcs[@]}"; do
    bin=${srcs[$i]}/b/bin/rdep
    [ "${srcs[$i]}" = . ] && bin=build-dev/bin/rdep
    echo "${names[$i]}: $("$bin" "${args[@]}" | grep -E 'gpu solve|error' | tr '\n' ' ')"
  done
done
if [ "${FINE:-0}" = 1 ]; then  # the working tree only
  build . build-fine balance_test -DCMAKE_CUDA_FLAGS=-DRDEP_GPU_PLANNER_FINE_STAMPS &&
    build-fine/src/balance/balance_test --gtest_filter='*Phases*' | grep -E '^fine' | head -2
fi
