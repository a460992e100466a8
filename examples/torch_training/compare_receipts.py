#!/usr/bin/env python3
"""The side-by-side summary of two training runs made in separate processes: train.py's receipts of one variant each
(say `--moe rdep --json a.json` and `--moe torchtitan --json b.json`), compared as train.py compares the two variants of
one process (tokens/s ratio, peak memory ratios, the loss-agreement criterion over --agree-from..--agree-to).

  python3 examples/torch_training/compare_receipts.py RDEP.json BASELINE.json [--agree-from 100 --agree-to 200]
      [--json OUT.json]

The two runs must have trained the same model on the same data: model shape, seed, tokens a step, steps, learning
rate schedule, gradient accumulation and clip are checked, and a difference is named.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train  # noqa: E402

# The receipt's args that make two runs comparable (the MoE variant and its own flags may differ).
SAME_ARGS = ("seed", "steps", "batch", "grad_accum", "lr", "warmup", "weight_decay", "clip", "bias_rate", "device",
             "eval_batches", "compile", "compile_mode", "timing")
ARG_DEFAULTS = {"timing": "synced"}  # receipts written before the option existed


def load(path: str) -> dict:
    """The receipt, which must hold exactly one variant (a run of --moe rdep, torchtitan or reference)."""
    try:
        receipt = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: cannot read a receipt ({e})")
    variants = receipt.get("variants")
    if not isinstance(variants, list) or len(variants) != 1:
        n = len(variants) if isinstance(variants, list) else "no"
        raise SystemExit(f"{path}: expected a receipt of one variant (train.py --moe rdep|torchtitan|reference), "
                         f"found {n} variants")
    return receipt


def backward_autocast(config: dict):
    """The compiled backward's autocast setting a run trained under: None for an eager run; a compiled run's receipt
    written before the setting was recorded ran under torch's default, same_as_forward."""
    if not config["args"].get("compile"):
        return None
    return config.get("compiled_backward_autocast") or "same_as_forward"


def check_comparable(a: dict, b: dict, pa: str, pb: str) -> None:
    """SystemExit naming the first field in which the two runs' training differs."""
    ca, cb = a["config"], b["config"]
    for key in ("model", "world_size", "tokens_per_step"):
        if ca.get(key) != cb.get(key):
            raise SystemExit(f"config.{key} differs: {ca.get(key)} in {pa}, {cb.get(key)} in {pb}")
    va, vb = backward_autocast(ca), backward_autocast(cb)
    if va != vb:
        raise SystemExit(f"config.compiled_backward_autocast differs: {va} in {pa}, {vb} in {pb}")
    for key in SAME_ARGS:
        va, vb = ca["args"].get(key, ARG_DEFAULTS.get(key)), cb["args"].get(key, ARG_DEFAULTS.get(key))
        if va != vb:
            raise SystemExit(f"config.args.{key} differs: {va} in {pa}, {vb} in {pb}")
    if a["corpus"].get("sha256") != b["corpus"].get("sha256"):
        raise SystemExit(f"corpus differs: sha256 {a['corpus'].get('sha256')} in {pa}, {b['corpus'].get('sha256')} in {pb}")


class _Printer:
    def print(self, *args) -> None:
        print(*args)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rdep", help="the receipt of the run to compare (first column)")
    p.add_argument("baseline", help="the receipt of the baseline run (second column)")
    p.add_argument("--agree-from", type=int, default=100)
    p.add_argument("--agree-to", type=int, default=200)
    p.add_argument("--json", default="", help="write the comparison here")
    a = p.parse_args(argv)
    ra, rb = load(a.rdep), load(a.baseline)
    check_comparable(ra, rb, a.rdep, a.baseline)
    recs = [ra["variants"][0], rb["variants"][0]]
    cmp = train.compare(recs, a)
    train.print_summary(recs, cmp, _Printer(), ra.get("cuda") is not None)
    if a.json:
        Path(a.json).write_text(json.dumps({"receipts": [a.rdep, a.baseline], "comparison": cmp}, indent=1) + "\n")
    return cmp


if __name__ == "__main__":
    main()
