"""bench/lab/kernel_trace_summary.py on synthetic traces in kernel_trace.cc's format (no GPU needed): iterations cut at
the anchor kernel, consecutive iterations with the same kernels (names, grids, blocks) one run, each run's warm-up left
out, per position the median duration and the gap before it (against the latest end so far: negative where kernels
overlapped, also across streams), per iteration the span, the kernels' sum and the idle time; short names for
demangled, mangled and CUTLASS kernels, #k where two share one; a malformed trace refused with its line."""

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
GEMM_MC = "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalIKernelPtrArrayTmaWarpSpecializedCooperativeMMA_64x256x16_MULTICAST"
PASS = "void rdep::kernels::internal::(anonymous namespace)::SwigluForwardKernel<8>(__nv_bfloat16 const*, long)"
HEADER = "start_ns\tend_ns\tstream\tgrid\tblock\tname_id"


def write_trace(path: Path, kernels: list[tuple], shuffle: bool = False) -> None:
    """kernels: (name, start_ns, end_ns[, grid[, block[, stream]]]); written in reverse start order when shuffle (the
    summary must sort them)."""
    names: dict[str, int] = {}
    lines = []
    for k in kernels:
        name, start, end = k[:3]
        grid, block, stream = (list(k[3:]) + ["132x1x1", "384x1x1", 7][len(k) - 3:])[:3]
        i = names.setdefault(name, len(names))
        lines.append(f"{start}\t{end}\t{stream}\t{grid}\t{block}\t{i}")
    if shuffle:
        lines.reverse()
    lines += [f"#name\t{i}\t{n}" for n, i in names.items()]
    path.write_text("\n".join([HEADER] + lines) + "\n")


def test_runs_medians_gaps_idle_and_names(tmp_path, capsys):
    kernels = []
    t = 1000
    gemm_us = (100, 100, 100, 500)  # median 100, mean 200
    setup_gap_us = (3, 3, 3, 11)  # median 3, mean 5
    for g, sg in zip(gemm_us, setup_gap_us):  # run 1: setup, a gap, the GEMM, the pass overlapping the GEMM's last 1 us
        gs = t + 2000 + sg * 1000
        ge = gs + g * 1000
        kernels += [(SETUP, t, t + 2000), (GEMM, gs, ge), (PASS, ge - 1000, ge + 49_000)]
        t += 1_000_000
    for _ in range(3):  # run 2: setup, then the pass 0.5 us later
        kernels += [(SETUP, t, t + 2000), (PASS, t + 2500, t + 12_500)]
        t += 100_000
    trace = tmp_path / "trace.tsv"
    write_trace(trace, kernels, shuffle=True)
    out_json = tmp_path / "sum.json"
    assert kts.main([str(trace), "--skip", "0", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    got = json.loads(out_json.read_text())
    runs = got["groups"]
    assert [r["iterations"] for r in runs] == [4, 3]
    first = runs[0]["kernels"]
    assert [k["name"] for k in first] == ["ForwardSetupKernel", "cutlass coop 64x256", "SwigluForwardKernel"]
    assert first[0]["us"] == pytest.approx(2.0) and first[0]["gap_us"] is None
    assert first[1]["us"] == pytest.approx(100.0)  # the median, not the mean (200)
    assert first[1]["gap_us"] == pytest.approx(3.0)  # the median, not the mean (5)
    assert first[2]["gap_us"] == pytest.approx(-1.0)  # started 1 us before the GEMM ended
    assert runs[0]["span_us"] == pytest.approx(2.0 + 3.0 + 100.0 + 49.0)  # median over iterations (the slow one 562)
    assert runs[0]["kernel_sum_us"] == pytest.approx(2.0 + 100.0 + 50.0)
    assert runs[0]["idle_us"] == pytest.approx(3.0)  # the overlap is not idle time; the median, not the mean (5)
    second = runs[1]
    assert second["kernels"][1]["gap_us"] == pytest.approx(0.5)
    assert second["span_us"] == pytest.approx(12.5)
    assert second["kernel_sum_us"] == pytest.approx(12.0)
    assert second["idle_us"] == pytest.approx(0.5)
    assert "cutlass coop 64x256" in printed and got["names"]["SwigluForwardKernel"] == PASS
    assert "warm-up kept" not in printed


def test_overlap_on_another_stream_counts_against_the_latest_end(tmp_path):
    # A long kernel, a short one inside it on another stream, then one starting 2 us after the long one ends: the gap is
    # measured from the long kernel's end (the latest so far), not from the short kernel's.
    trace = tmp_path / "trace.tsv"
    write_trace(trace, [(SETUP, 0, 100_000), (PASS, 10_000, 20_000, "8x1x1", "256x1x1", 9), (GEMM, 102_000, 110_000)])
    its = kts.split_iterations(kts.read_trace(str(trace)), "ForwardSetupKernel")
    durs, gaps, span, busy, idle = kts.iteration_times(its[0])
    assert gaps == pytest.approx([-90.0, 2.0])
    assert span == pytest.approx(110.0) and busy == pytest.approx(118.0) and idle == pytest.approx(2.0)
    # the kernel that starts last ends first: the span runs to the latest end, not to the last kernel's
    write_trace(trace, [(SETUP, 0, 100_000), (GEMM, 5_000, 50_000, "132x1x1", "384x1x1", 9)])
    its = kts.split_iterations(kts.read_trace(str(trace)), "ForwardSetupKernel")
    durs, gaps, span, busy, idle = kts.iteration_times(its[0])
    assert gaps == pytest.approx([-95.0]) and span == pytest.approx(100.0) and idle == pytest.approx(0.0)


def test_skip_and_its_boundary(tmp_path):
    kernels, t = [], 0
    for g in (500_000, 400_000, 300_000, 100_000, 100_000):  # three slow warm-up iterations
        kernels += [(SETUP, t, t + 1000), (GEMM, t + 1000, t + 1000 + g)]
        t += 1_000_000
    trace = tmp_path / "trace.tsv"
    write_trace(trace, kernels)
    its = kts.split_iterations(kts.read_trace(str(trace)), "ForwardSetupKernel")

    def gemm_us(skip):
        run = kts.summarize(its, kts.Names(), skip=skip)[0]
        return run["iterations"], run["warmup_kept"], run["kernels"][1]["us"], run["span_us"]

    assert gemm_us(3) == (2, False, pytest.approx(100.0), pytest.approx(101.0))
    assert gemm_us(0) == (5, False, pytest.approx(300.0), pytest.approx(301.0))  # the warm-up counted
    assert gemm_us(4) == (1, False, pytest.approx(100.0), pytest.approx(101.0))
    assert gemm_us(5) == (5, True, pytest.approx(300.0), pytest.approx(301.0))  # no more iterations than skip: all kept


def test_a_different_grid_or_block_starts_another_run_and_shared_names_get_suffixes(tmp_path, capsys):
    kernels, t = [], 0
    for grid, block in (("132x1x1", "384x1x1"),) * 2 + (("64x1x1", "384x1x1"),) * 2 + (("64x1x1", "128x1x1"),) * 2:
        kernels += [(SETUP, t, t + 1000), (GEMM, t + 1000, t + 9000, grid, block), (GEMM_MC, t + 9000, t + 19_000)]
        t += 100_000
    trace = tmp_path / "trace.tsv"
    write_trace(trace, kernels)
    out_json = tmp_path / "sum.json"
    assert kts.main([str(trace), "--skip", "0", "--min-iterations", "1", "--json", str(out_json)]) == 0
    runs = json.loads(out_json.read_text())["groups"]
    assert [r["iterations"] for r in runs] == [2, 2, 2]
    assert [(r["kernels"][1]["grid"], r["kernels"][1]["block"]) for r in runs] == [
        ("132x1x1", "384x1x1"), ("64x1x1", "384x1x1"), ("64x1x1", "128x1x1")]
    assert [k["name"] for k in runs[0]["kernels"]] == ["ForwardSetupKernel", "cutlass coop 64x256", "cutlass coop 64x256 mc"]
    # runs of fewer than --min-iterations are left out, and the count is said
    assert kts.main([str(trace), "--skip", "0", "--min-iterations", "3"]) == 0
    assert "6 iterations in runs of fewer than 3 left out" in capsys.readouterr().err
    # a run with no more iterations than --skip keeps them, and says so
    assert kts.main([str(trace), "--skip", "2", "--min-iterations", "1"]) == 0
    assert capsys.readouterr().out.count("warm-up kept") == 3
    for bad in (["--skip", "-1"], ["--min-iterations", "0"]):
        with pytest.raises(SystemExit):
            kts.main([str(trace)] + bad)
    assert "--skip must be >= 0" in capsys.readouterr().err


def test_short_names():
    assert kts.short_name(SETUP) == "ForwardSetupKernel"
    assert kts.short_name(PASS) == "SwigluForwardKernel"
    assert kts.short_name("_ZN4rdep7kernels8internal5tiled20BuildGroupMapsKernelIN7cutlass") == "BuildGroupMapsKernel"
    assert kts.short_name("_ZN7cutlass13device_kernelIPingpongMMA_64x128x16SM90_TMA_LOAD_MULTICAST") == "cutlass ping 64x128 mc"
    names = kts.Names()
    assert [names(GEMM), names(GEMM + "X"), names(GEMM)] == ["cutlass coop 64x256", "cutlass coop 64x256#1", "cutlass coop 64x256"]


def test_no_anchor_and_bad_lines(tmp_path, capsys):
    trace = tmp_path / "trace.tsv"
    write_trace(trace, [(PASS, 0, 10)])
    assert kts.main([str(trace)]) == 1
    assert "no kernel named like" in capsys.readouterr().err
    trace.write_text(HEADER + "\n1\t2\t3\n")
    with pytest.raises(SystemExit, match=r"trace.tsv:2: expected 6"):
        kts.read_trace(str(trace))
    trace.write_text(HEADER + "\n1\t2\t3\t1x1x1\t1x1x1\t9\n")
    with pytest.raises(SystemExit, match="name id 9 has no #name"):
        kts.read_trace(str(trace))
    trace.write_text("start_ns\tend_ns\tstream\tgrid\tblock\tname\n")
    with pytest.raises(SystemExit, match="expected the header"):
        kts.read_trace(str(trace))
