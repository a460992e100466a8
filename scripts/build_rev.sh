#!/usr/bin/env bash
# Builds the `rdep` command of another commit beside the working tree's, for an A/B in one device call
# (both binaries timed alternately on the same machine). The commit must be in the checkout's .git as the
# device has it (the session's starting commit and its ancestors; commits made later in the session are
# not there). Prints the binary's path last.
#   B=$(bash scripts/build_rev.sh e931ae8 | tail -1); $B bench dispatch --ranks 2 ...; build-dev/bin/rdep bench dispatch ...
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: build_rev.sh COMMIT}
dir=/tmp/rdep_rev_$rev
git rev-parse --verify -q "$rev^{commit}" >/dev/null || { echo "build_rev: $rev is not in this checkout's .git" >&2; exit 2; }
[ -d "$dir" ] || git worktree add -f --detach "$dir" "$rev" >/dev/null
[ -d .whl ] && [ ! -e "$dir/.whl" ] && ln -s "$PWD/.whl" "$dir/.whl"  # the pinned CUTLASS wheel, when carried
cmake -S "$dir" -B "$dir/b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRDEP_BUILD_TESTS=OFF >"$dir/configure.log" 2>&1 ||
  { tail -20 "$dir/configure.log" >&2; exit 1; }
cmake --build "$dir/b" -j "$(nproc)" --target rdep >"$dir/build.log" 2>&1 || { tail -20 "$dir/build.log" >&2; exit 1; }
echo "$dir/b/bin/rdep"
