"""Timing for ``calibrate_gpu``: a callable on the GPU as CUDA-graph replays between CUDA
events (eager where capture fails), after warm-up; the median of the repeats."""

from __future__ import annotations

import statistics
import time


class Timer:
    """Times a callable on the GPU: CUDA graph of one call (eager if capture fails), replayed."""

    def __init__(self, torch, *, warmup: int, repeats: int, use_graphs: bool = True) -> None:
        self.torch = torch
        self.warmup = warmup
        self.repeats = repeats
        self.use_graphs = use_graphs and torch.cuda.is_available()

    def __call__(self, fn) -> dict:
        torch = self.torch
        if not torch.cuda.is_available():  # --allow-cpu smoke test only
            fn()
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return _summary(times, graph=False)
        runner, graph, note = fn, None, None
        if self.use_graphs:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                runner = graph.replay
            except Exception as exc:  # some kernels refuse capture: time them eagerly
                torch.cuda.synchronize()
                graph, runner = None, fn
                note = f"graph capture failed, eager timing: {type(exc).__name__}: {exc}"[:300]
        for _ in range(self.warmup):
            runner()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        for start, end in zip(starts, ends, strict=True):
            start.record()
            runner()
            end.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]
        del graph
        out = _summary(times, graph=runner is not fn)
        if note:
            out["note"] = note
        return out


def _summary(times: list[float], *, graph: bool) -> dict:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "repeats": len(times),
        "cuda_graph": graph,
    }


def rate(value: float, seconds: float) -> float:
    return value / seconds if seconds > 0 else float("nan")


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]
