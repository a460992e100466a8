"""python -m rdep.torch build-eager-ext: compiles rdep.torch's eager C++ path (eager_ext.py) ahead of its first use, into
torch's extension cache (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions), printing the compiler's output."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["build-eager-ext"]:
        print("usage: python -m rdep.torch build-eager-ext", file=sys.stderr)
        return 2
    from . import eager_ext

    mod = eager_ext.build(verbose=True)
    print(f"rdep.torch eager C++ path: built ({mod.__name__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
