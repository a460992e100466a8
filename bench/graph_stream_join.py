"""What a fork and join to a side stream cost, replayed in a CUDA graph and eagerly: N small kernels on the current
stream, against the same kernels on a side stream that waits for the current one and is waited for after them (events,
as rdep's C ABI joins the caller's stream to the layer's stream around each call). torch only; the device times of
back-to-back calls (p50 of event pairs), so the eager figures are the host's issue rate for kernels this small.

    python3 bench/graph_stream_join.py
"""

from __future__ import annotations

import statistics

import torch

from torch_layer_bench import captured, time_loop

KERNELS = 20


def main() -> None:
    x = torch.zeros(1024, device="cuda")
    side = torch.cuda.Stream()
    ev_in, ev_out = torch.cuda.Event(), torch.cuda.Event()

    def plain():
        for _ in range(KERNELS):
            x.add_(1)

    def joined():
        cur = torch.cuda.current_stream()
        ev_in.record(cur)
        side.wait_event(ev_in)
        with torch.cuda.stream(side):
            plain()
            ev_out.record(side)
        cur.wait_event(ev_out)

    for rnd in range(2):
        for name, fn in (("plain", plain), ("joined", joined)):
            graph, _ = captured(fn)
            print(f"round {rnd} {name:8s} eager {p50_us(fn):7.1f} us   graph replay {p50_us(graph.replay):7.1f} us  "
                  f"({KERNELS} kernels)")


def p50_us(fn) -> float:
    return statistics.median(time_loop(fn, 20, 300)[0]) * 1e3  # the device's time per call (events, back to back)


if __name__ == "__main__":
    main()
