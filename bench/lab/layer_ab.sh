#!/usr/bin/env bash
# Lab: A/B of `rdep bench layer` between rdep binaries in one device call, alternating them ROUNDS
# times (default 3) so that machine drift hits every version alike; prints each run's forward and
# forward+backward p50/p99 lines and keeps each run's JSON receipt under $OUT.
#   bash bench/lab/layer_ab.sh NAME=BIN [NAME=BIN ...] -- [rdep bench layer flags]
# e.g. (a base tree built beside the working tree's build-dev):
#   bash bench/lab/layer_ab.sh base=.ab/base/b/bin/rdep new=build-dev/bin/rdep -- --ranks 1
set -uo pipefail
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
names=() bins=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  names+=("${1%%=*}") bins+=("${1#*=}")
  shift
done
[ "${1:-}" = "--" ] && shift
[ ${#bins[@]} -gt 0 ] || { echo "usage: layer_ab.sh NAME=BIN [NAME=BIN ...] -- [bench layer flags]" >&2; exit 2; }
for round in $(seq "$ROUNDS"); do
  for i in "${!bins[@]}"; do
    json="$OUT/layer_ab_${names[$i]}_$round.json"
    echo "${names[$i]} round $round: $("${bins[$i]}" bench layer "$@" --json "$json" 2>&1 |
      grep -E '^  (forward|forward\+backward) |error|memory' | tr -s ' ' | tr '\n' '|')"
  done
done
