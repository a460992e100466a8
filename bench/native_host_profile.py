"""Where a call's host time goes below Python too: py-spy samples the process natively (C, C++ and the CUDA driver's
frames beside the Python ones) while a loop issues the call on an idle device, and the samples taken while the call
was being issued are summed by where they were (bench/torch_layer_bench.py --native-profile SECONDS).

The loop alternates two functions whose names mark the samples: `_issue_call` (the timed call) and `_idle_wait`
(torch.cuda.synchronize between calls, left out). Samples of the main thread count while it issues a call; those of the
other threads (autograd's device thread, which runs the backward of CUDA tensors, the CUDA driver's) all count. A sample
whose innermost frames block on another thread (BLOCKED; py-spy counted these as running on the GPU machines) is not
work: the main thread's (waiting in the engine for the device thread) is counted apart, the other threads' left out.
Figures are µs per call: samples / rate / calls. py-spy stops the process for each native sample, so the process runs
slower and the device finishes more of its work meanwhile: read the shares, and time the host without the profiler
(--timeline, the host p50).

Needs py-spy (pip install py-spy) on PATH or beside the interpreter; the process must be allowed to trace itself
(ptrace: root, or kernel.yama.ptrace_scope 0).
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ISSUE, WAIT = "_issue_call", "_idle_wait"
# Functions in which a thread is blocked (py-spy counts such threads as running on some hosts): the calling thread waiting
# in the autograd engine for its device thread, the device thread waiting for work, a driver thread polling. A sample with
# one of these (or a futex wait) among its innermost frames is not work.
BLOCKED = frozenset({"pthread_cond_wait", "pthread_cond_timedwait", "pthread_cond_clockwait", "sem_wait", "sem_timedwait",
                     "epoll_wait", "epoll_pwait", "poll", "ppoll", "__poll", "select", "pselect", "nanosleep",
                     "clock_nanosleep", "__nanosleep"})


def _blocked(frame: str) -> bool:
    name = frame[:frame.rfind(" (")] if frame.endswith(")") and " (" in frame else frame
    return name in BLOCKED or "futex_wait" in name


def _py_spy() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return shutil.which("py-spy") or (beside if os.path.exists(beside) else None)


def _issue_call(fn) -> None:
    fn()


def _idle_wait() -> None:
    torch.cuda.synchronize()


def record(fn, seconds: float, rate: int = 400) -> tuple[str, int, int, int] | None:
    """Samples this process with py-spy (--native --threads, raw output) while calling fn on an idle device for about
    `seconds`; returns (the raw samples' text, calls made, calls after which the device had already finished all the
    call's work: a call that waits for its own work, or whose host time exceeds it, the rate asked of py-spy), or None
    (printed why) without py-spy or when it fails. py-spy may sample below the rate asked (it says so on its output):
    the µs then come out low, the shares stay."""
    exe = _py_spy()
    if exe is None:
        print("native_host_profile: no py-spy on PATH (pip install py-spy): skipped", file=sys.stderr)
        return None
    fd, out = tempfile.mkstemp(suffix=".txt")
    os.close(fd)
    os.unlink(out)  # py-spy writes it: its absence then says py-spy wrote nothing
    cmd = [exe, "record", "--native", "--threads", "-r", str(rate), "-f", "raw", "-o", out,
           "--pid", str(os.getpid()), "-d", str(int(seconds) + 1)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.0)  # py-spy attaches
        calls, done, end = 0, 0, time.monotonic() + seconds
        while time.monotonic() < end and proc.poll() is None:
            _idle_wait()
            _issue_call(fn)
            mark = torch.cuda.Event()
            mark.record()
            done += bool(mark.query())
            calls += 1
        _idle_wait()
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # fn raised, or py-spy outlived its duration
            proc.kill()
            proc.communicate()
    if proc.returncode != 0 or not os.path.exists(out):
        print(f"native_host_profile: py-spy failed (rc {proc.returncode}): {log.strip()[-800:]}", file=sys.stderr)
        return None
    with open(out) as f:
        text = f.read()
    os.unlink(out)
    return text, calls, done, rate


def _library(frame: str) -> str:
    """The library a native frame is in ('name (libfoo.so.1)' -> 'libfoo'), or 'python' for a Python frame."""
    if frame.endswith(")") and "(" in frame:
        where = frame[frame.rfind("(") + 1:-1]
        if ".py:" in where or where.startswith("<"):
            return "python"
        if ".so" in where:
            return where.split(".so")[0]
    return "other"


def _owner(frames: list[str]) -> str:
    """The innermost Python frame of a stack (file:function), the code on whose behalf the native frames below run."""
    for f in reversed(frames):
        if _library(f) == "python":
            name, where = f[:f.rfind("(")].strip(), f[f.rfind("(") + 1:-1]
            return f"{where.split(':')[0].split('/')[-1]}:{name}"
    return "(no Python frame)"


def _tail(frames: list[str], depth: int = 4) -> str:
    """The innermost `depth` frames, innermost last, shortened: where a sample's thread was."""
    return " < ".join(f[:70] for f in reversed(frames[-depth:]))


def summarize(text: str, calls: int, done: int = -1, rate: int = 400, top: int = 25) -> dict:
    """µs per call by the leaf frame's library, by the innermost Python function, and by thread, over the samples taken
    while a call was being issued (see the module docstring). The main thread's samples blocked on another thread while
    it issued a call (waiting in the autograd engine for its device thread) are counted apart; the other threads' blocked
    samples are left out (they span the whole recording: a device thread waits for work between calls too)."""
    scale = 1e6 / rate / max(calls, 1)
    by_lib, by_owner, by_thread, by_leaf = (collections.Counter() for _ in range(4))
    by_thread_tail: dict = collections.defaultdict(collections.Counter)
    blocked = collections.Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if any(WAIT in f for f in frames):
            continue
        if frames[0].startswith("process") and len(frames) > 1:  # py-spy --subprocesses puts the process first
            frames = frames[1:]
        thread = frames[0] if frames[0].startswith("thread") else "?"
        main_thread = any(ISSUE in f for f in frames)
        if not main_thread and (thread == "?" or thread.endswith("MainThread")):
            continue  # the main thread between calls (or a stack py-spy could not name a thread for)
        n = int(count) * scale
        name = "main (issuing)" if main_thread else thread
        if any(_blocked(f) for f in frames[-4:]):
            if main_thread:
                blocked[name] += n
            continue
        by_thread[name] += n
        by_thread_tail[name][_tail(frames)] += n
        by_lib[_library(frames[-1])] += n
        by_owner[_owner(frames)] += n
        by_leaf[frames[-1][:120]] += n
    out = {"calls": calls, "rate_hz": rate, "device_done_at_return": done,
           "us_per_call_by_thread": dict(by_thread.most_common()),
           "us_per_call_blocked_while_issuing": dict(blocked.most_common()),
           "us_per_call_by_leaf_library": dict(by_lib.most_common()),
           "us_per_call_by_python_function": dict(by_owner.most_common(top)),
           "us_per_call_by_leaf_frame": dict(by_leaf.most_common(top)),
           "us_per_call_by_thread_and_innermost_frames": {t: dict(c.most_common(12)) for t, c in by_thread_tail.items()}}
    return out


def print_summary(title: str, s: dict) -> None:
    print(f"native host profile of {title}: {s['calls']} calls sampled at {s['rate_hz']} Hz (µs per call); the device had "
          f"finished the call's work when it returned after {s['device_done_at_return']} of them")
    for key in ("us_per_call_by_thread", "us_per_call_blocked_while_issuing", "us_per_call_by_leaf_library",
                "us_per_call_by_python_function", "us_per_call_by_leaf_frame"):
        print(f"  {key[len('us_per_call_'):].replace('_', ' ')}:")
        for name, us in s[key].items():
            print(f"    {us:9.1f}  {name}")
    for thread, tails in s["us_per_call_by_thread_and_innermost_frames"].items():
        print(f"  thread {thread}, by its innermost frames:")
        for name, us in tails.items():
            print(f"    {us:9.1f}  {name}")
