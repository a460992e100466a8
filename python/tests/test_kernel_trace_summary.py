"""bench/lab/kernel_trace_summary.py on a synthetic trace in kernel_trace.cc's format (no GPU needed): iterations cut at
the anchor kernel, consecutive iterations with the same kernels one run, per position the median duration and the gap
before it (negative where kernels overlapped), the span, the kernels' and the gaps' sums; short names for demangled,
mangled and CUTLASS kernels; a malformed trace refused with its line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_library  # a script test: no librdep_capi.so needed

PATH = Path(__file__).resolve().parents[2] / "bench" / "lab" / "kernel_trace_summary.py"
spec = importlib.util.spec_from_file_location("kernel_trace_summary", PATH)
kts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kts)

SETUP = "rdep::kernels::(anonymous namespace)::ForwardSetupKernel(rdep::kernels::(anonymous namespace)::ForwardSetup)"
GEMM = "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalIKernelPtrArrayTmaWarpSpecializedCooperativeMMA_64x256x16_F32"
PASS = "void rdep::kernels::internal::(anonymous namespace)::SwigluForwardKernel<8>(__nv_bfloat16 const*, long)"


def write_trace(path: Path, iterations: list[list[tuple[str, int, int]]]) -> None:
    """iterations: lists of (name, start_ns, end_ns)."""
    names: dict[str, int] = {}
    lines = ["start_ns\tend_ns\tstream\tgrid\tblock\tname_id"]
    for it in iterations:
        for name, start, end in it:
            i = names.setdefault(name, len(names))
            lines.append(f"{start}\t{end}\t7\t132x1x1\t384x1x1\t{i}")
    lines += [f"#name\t{i}\t{n}" for n, i in names.items()]
    path.write_text("\n".join(lines) + "\n")


def test_runs_medians_gaps_and_names(tmp_path, capsys):
    its = []
    t = 1000
    for k in range(4):  # run 1: setup, gemm (its duration 100, 110, 120, 130 us), the pass overlapping it by 1 us
        g = 100_000 + 10_000 * k
        its.append([(SETUP, t, t + 2000), (GEMM, t + 3000, t + 3000 + g), (PASS, t + 2000 + g, t + 2000 + g + 50_000)])
        t += 400_000
    for _ in range(3):  # run 2: setup then the pass alone
        its.append([(SETUP, t, t + 2000), (PASS, t + 2500, t + 12_500)])
        t += 100_000
    trace = tmp_path / "trace.tsv"
    write_trace(trace, its)
    out_json = tmp_path / "sum.json"
    assert kts.main([str(trace), "--skip", "0", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    got = json.loads(out_json.read_text())
    runs = got["groups"]
    assert [r["iterations"] for r in runs] == [4, 3]
    first = runs[0]["kernels"]
    assert [k["name"] for k in first] == ["ForwardSetupKernel", "cutlass coop 64x256", "SwigluForwardKernel"]
    assert first[0]["us"] == pytest.approx(2.0) and first[0]["gap_us"] is None
    assert first[1]["us"] == pytest.approx(115.0)  # median of 100, 110, 120, 130
    assert first[1]["gap_us"] == pytest.approx(1.0)
    assert first[2]["gap_us"] == pytest.approx(-1.0)  # started 1 us before the GEMM ended
    assert runs[0]["span_us"] == pytest.approx(2.0 + 115.0 + 50.0)
    assert runs[0]["kernel_sum_us"] == pytest.approx(2.0 + 115.0 + 50.0 + 1.0 - 1.0 - 1.0 + 1.0)
    assert runs[0]["gap_sum_us"] == pytest.approx(0.0)
    assert runs[1]["kernels"][1]["gap_us"] == pytest.approx(0.5)
    assert runs[1]["span_us"] == pytest.approx(12.5)
    assert "cutlass coop 64x256" in printed and got["names"]["SwigluForwardKernel"] == PASS


def test_skip_leaves_out_each_runs_first_iterations(tmp_path):
    its, t = [], 0
    for g in (500_000, 100_000, 100_000, 100_000):  # a slow first iteration
        its.append([(SETUP, t, t + 1000), (GEMM, t + 1000, t + 1000 + g)])
        t += 1_000_000
    trace = tmp_path / "trace.tsv"
    write_trace(trace, its)
    names = kts.Names()
    all_its = kts.split_iterations(kts.read_trace(str(trace)), "ForwardSetupKernel")
    assert kts.summarize(all_its, names, skip=1)[0]["kernels"][1]["us"] == pytest.approx(100.0)
    assert kts.summarize(all_its, names, skip=1)[0]["iterations"] == 3


def test_short_names():
    assert kts.short_name(SETUP) == "ForwardSetupKernel"
    assert kts.short_name(PASS) == "SwigluForwardKernel"
    assert kts.short_name("_ZN4rdep7kernels8internal5tiled20BuildGroupMapsKernelIN7cutlass") == "BuildGroupMapsKernel"
    assert kts.short_name("_ZN7cutlass13device_kernelIPingpongMMA_64x128x16SM90_TMA_LOAD_MULTICAST") == "cutlass ping 64x128 mc"


def test_no_anchor_and_bad_lines(tmp_path, capsys):
    trace = tmp_path / "trace.tsv"
    write_trace(trace, [[(PASS, 0, 10)]])
    assert kts.main([str(trace)]) == 1
    assert "no kernel named like" in capsys.readouterr().err
    trace.write_text("start_ns\tend_ns\tstream\tgrid\tblock\tname_id\n1\t2\t3\n")
    with pytest.raises(SystemExit, match=r"trace.tsv:2: expected 6"):
        kts.read_trace(str(trace))
    trace.write_text("start_ns\tend_ns\tstream\tgrid\tblock\tname_id\n1\t2\t3\t1x1x1\t1x1x1\t9\n")
    with pytest.raises(SystemExit, match="name id 9 has no #name"):
        kts.read_trace(str(trace))
