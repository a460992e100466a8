#!/usr/bin/env python3
"""The programmatic-dependent-launch contract (src/launch/pdl.h), checked in the sources: in every CUDA
file (.cu, .cuh) under the given directory that launches with RDEP_LAUNCH_PDL, cuda::LaunchPdl or LaunchPdlError, every
__global__ kernel's body begins with cuda::WaitForPrimaryGrid(); (a kernel launched with PDL that touches memory before
it waits could read the previous kernel's rows before they land, or overwrite what that kernel still reads).
Exit 1 naming each kernel that does not, or each __global__ this script could not parse; 2 when no file launches with
PDL (the check would pass vacuously)."""
import pathlib
import re
import sys

WAIT = "cuda::WaitForPrimaryGrid();"
LAUNCH = re.compile(r"\b(RDEP_LAUNCH_PDL|LaunchPdl|LaunchPdlError)\s*[<(]")


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def closing(text, i):
    """Index of the parenthesis closing the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return j
    raise ValueError("unbalanced parentheses")


def kernels(text):
    """(name, first statement of the body) for each __global__ in comment-free text: name None when it could not be
    parsed, first None for a declaration without a body."""
    for m in re.finditer(r"\b__global__\b", text):
        i = m.end()
        name = None
        while i < len(text):  # skip qualifiers and __launch_bounds__(...) up to the name before the parameters
            w = re.match(r"\s*(__launch_bounds__\s*\(|static\b|inline\b|__forceinline__\b|void\b|([A-Za-z_]\w*)\s*\()", text[i:])
            if not w:
                break
            if w.group(1).startswith("__launch_bounds__"):
                i = closing(text, i + w.end() - 1) + 1
            elif w.group(2):
                name, i = w.group(2), i + w.end() - 1
                break
            else:
                i += w.end()
        if name is None:
            yield None, text[m.start():m.start() + 80]
            continue
        rest = text[closing(text, i) + 1:].lstrip()
        if rest.startswith(";"):
            yield name, None  # a declaration
            continue
        if not rest.startswith("{"):
            yield None, text[m.start():m.start() + 80]
            continue
        yield name, rest[1:].lstrip().split("\n", 1)[0].strip()


def main(root):
    paths = sorted(p for p in pathlib.Path(root).rglob("*") if p.suffix in (".cu", ".cuh"))
    files = [(p, strip_comments(p.read_text())) for p in paths]
    files = [(p, t) for p, t in files if LAUNCH.search(t)]
    if not files:
        print(f"check_pdl_waits: no file under {root} launches with PDL")
        return 2
    bad, count = [], 0
    for p, text in files:
        found = list(kernels(text))
        if len(found) != len(re.findall(r"\b__global__\b", text)):
            bad.append(f"{p}: not every __global__ was read")
        for name, first in found:
            count += first is not None
            if name is None:
                bad.append(f"{p}: a __global__ this script cannot parse: '{first}'")
            elif first is not None and not first.startswith(WAIT):
                bad.append(f"{p}: kernel {name} begins with '{first[:60]}', not {WAIT}")
    for b in bad:
        print(b)
    print(f"check_pdl_waits: {count} kernels in {len(files)} files, {len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "src"))
