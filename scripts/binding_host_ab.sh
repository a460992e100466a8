#!/usr/bin/env bash
# The binding's host time, an A/B of two rdep.torch trees on the same machine in one device call, alternated:
# bench/torch_layer_bench.py --host-breakdown (the C calls, rdep.torch's functions and the rest per call) with
# BASE's python/ against this tree's. The base travels as a folder (the device's .git may lack the commit):
#   git archive <rev> python/rdep | tar x -C shared/ab_base          # here; carry `shared`
#   bash scripts/device.sh --targets rdep_capi --no-pytest --tests NONE --bench 'bash scripts/binding_host_ab.sh shared/ab_base'
# Env: AB_ROUNDS (default 2), AB_TOKENS (default 4096); writes $OUT/ab_{base,new}_<round>.json.
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?usage: binding_host_ab.sh BASE_DIR (holding python/rdep)}
[ -d "$BASE/python/rdep" ] || { echo "binding_host_ab: $BASE/python/rdep missing" >&2; exit 2; }
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
shape=(--tokens "${AB_TOKENS:-4096}" --hidden 1024 --ffn 704 --experts 64 --topk 6 --expert-compute cutlass --gate-in-expert
       --iters 100 --host-breakdown 300)
fails=0
for r in $(seq "${AB_ROUNDS:-2}"); do
  for side in base new; do
    pp=$PWD/python
    [ "$side" = base ] && pp=$(cd "$BASE" && pwd)/python
    echo "== $side, round $r"
    log=/tmp/binding_host_ab_${side}_$r.log  # the whole output; its tail is printed when the run fails
    env PYTHONPATH="$pp:$PWD/bench" RDEP_LIBRARY="$PWD/build-dev/lib/librdep_capi.so" python3 bench/torch_layer_bench.py \
      "${shape[@]}" --json "$OUT/ab_${side}_$r.json" >"$log" 2>&1
    rc=$?
    grep -E "^  (forward|host breakdown)|^    (host |c_total|python|py:)" "$log"
    [ $rc -eq 0 ] || { echo "binding_host_ab: the $side run of round $r failed (rc $rc):"; tail -n 20 "$log"; fails=$((fails + 1)); }
  done
done
exit $((fails > 0))
