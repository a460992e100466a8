#!/usr/bin/env python3
"""The programmatic-dependent-launch contract (include/rdep/cuda/launch.h), checked in the sources: in every
CUDA file under the given directory that launches with cuda::LaunchPdl or cuda::LaunchPdlError, every __global__
kernel's body begins with cuda::WaitForPrimaryGrid(); (a kernel launched with PDL that reads before it waits could
read the previous kernel's rows before they land). Exit 1 naming each kernel that does not, 2 when no file
launches with PDL (the check would pass vacuously)."""
import pathlib
import re
import sys

WAIT = "cuda::WaitForPrimaryGrid();"


def kernels(text):
    """(name, first statement of the body) for each __global__ function defined in text."""
    for m in re.finditer(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\s*\([^)]*\)\s*)?(?:void\s+)?(\w+)\s*\(", text):
        depth, i = 0, m.end() - 1
        while True:  # the parameter list's closing parenthesis
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        rest = text[i + 1:]
        head = rest.lstrip()
        if head.startswith(";"):
            continue  # a declaration
        body = head[head.index("{") + 1:].lstrip()
        yield m.group(1), body.split("\n", 1)[0].strip()


def main(root):
    files = [p for p in sorted(pathlib.Path(root).rglob("*.cu")) if re.search(r"cuda::LaunchPdl(Error)?\(", p.read_text())]
    if not files:
        print(f"check_pdl_waits: no file under {root} launches with cuda::LaunchPdl")
        return 2
    bad, count = [], 0
    for p in files:
        for name, first in kernels(p.read_text()):
            count += 1
            if not first.startswith(WAIT):
                bad.append(f"{p}: kernel {name} begins with '{first[:60]}', not {WAIT}")
    for b in bad:
        print(b)
    print(f"check_pdl_waits: {count} kernels in {len(files)} files, {len(bad)} without the wait first")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "src"))
