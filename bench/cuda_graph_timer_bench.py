"""Cost of graph-timer nodes on the GPU (against the graph timer's overhead targets).

Captures a graph of N tiny kernels (default 2000) and measures its replay time (median of
repeated timed batches, torch.cuda.Event) in three states:
  untimed   the graph as captured, no timer nodes
  timed     one region around every kernel (2 event-record nodes each) + the empty region
  disabled  the same timed graph after GraphTimer.disable() (timer nodes taken out)
and prints the cost per event-record node ((timed - untimed) / nodes; target <= 2.5 us)
and the disabled-vs-untimed difference (target: zero within noise). Also prints the host
cost of GraphTimer.step() (event swapping) per replay.

    python bench/cuda_graph_timer_bench.py [--kernels 2000] [--replays 50]
"""

from __future__ import annotations

import argparse
import statistics
import time


def replay_ms(replay, replays: int, batches: int = 7) -> float:
    import torch

    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    per_batch = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            replay()
        end.record()
        end.synchronize()
        per_batch.append(start.elapsed_time(end) / replays)
    return statistics.median(per_batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=2000)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()

    import deepinfer._C.graph_timer as gt
    import torch
    from deepinfer_graph_timer import GraphTimer

    x = torch.zeros(256, device="cuda")

    def body():
        for _ in range(args.kernels):
            x.add_(1.0)

    def capture(timer: GraphTimer | None):
        g = torch.cuda.CUDAGraph(keep_graph=True)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            if timer is None:
                body()
            else:
                for i in range(args.kernels):
                    with timer.region(f"k{i % 8}"):
                        x.add_(1.0)
        return g

    body()
    untimed = capture(None)
    untimed.instantiate()

    timer = GraphTimer(gt, device=0)
    t0 = time.perf_counter()
    timed = capture(timer)
    handle = timer.attach(timed)
    timed.instantiate()
    setup_s = time.perf_counter() - t0
    nodes = sum(handle.node_type(n) == "event_record" for n in handle.nodes())
    # Alternate the two graphs so clock and thermal drift hit both alike.
    rounds_untimed, rounds_timed = [], []
    for _ in range(5):
        rounds_untimed.append(replay_ms(untimed.replay, args.replays))
        rounds_timed.append(replay_ms(timed.replay, args.replays))
    t_untimed, t_timed = statistics.median(rounds_untimed), statistics.median(rounds_timed)

    # Host cost of taking samples: replay + step() (swaps every node's event).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 20
    for _ in range(steps):
        timer.replay(timed)
    timer.synchronize()
    step_ms = (time.perf_counter() - t0) * 1000.0 / steps

    timer.disable()
    t_disabled = statistics.median(replay_ms(timed.replay, args.replays) for _ in range(3))
    timer.enable()
    t_reenabled = statistics.median(replay_ms(timed.replay, args.replays) for _ in range(3))

    per_node_us = (t_timed - t_untimed) * 1000.0 / nodes
    print(f"kernels per graph           : {args.kernels}")
    print(f"event-record nodes (timed)  : {nodes}")
    print(f"replay untimed              : {t_untimed * 1000:.1f} us")
    print(f"replay timed                : {t_timed * 1000:.1f} us")
    print(f"replay timing disabled      : {t_disabled * 1000:.1f} us  (disabled - untimed = {(t_disabled - t_untimed) * 1000:+.1f} us)")
    print(f"replay re-enabled           : {t_reenabled * 1000:.1f} us")
    print(f"cost per event-record node  : {per_node_us:.3f} us  (target <= 2.5 us)")
    print(f"GraphTimer.replay+step host : {step_ms:.2f} ms per replay ({nodes} event swaps)")
    print(f"capture+attach+instantiate  : {setup_s:.2f} s")
    print(f"empty-region cost measured  : {timer.overhead_ms() * 1000:.2f} us")


if __name__ == "__main__":
    main()
