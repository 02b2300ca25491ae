"""Kernel tables from torch.profiler recordings, shared by the benchmarks: idle time of the device,
kernels a step and the top kernels by device time, from live profiler events (bench_roofline,
bench_kimi) or from the Chrome traces LLMEngine.start_profile writes per rank (bench_tp)."""
from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace

DEVICE_TRACE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # device activity in a Chrome trace


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def profile_calls(fn: Callable[[], object], calls: int, activities: list, sync: Callable[[], None]):
    """(torch.profiler over `calls` calls of fn, their wall seconds), synchronized on both sides."""
    from torch.profiler import profile

    sync()
    wall = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync()
    return prof, time.perf_counter() - wall


def idle_stats(device_events: list, steps: int) -> dict:
    spans = [(e.time_range.start, e.time_range.end) for e in device_events]
    span_us = max(s[1] for s in spans) - min(s[0] for s in spans)
    busy_us = _union_us(spans)
    return dict(gpu_span_ms_per_step=1e-3 * span_us / steps, gpu_busy_ms_per_step=1e-3 * busy_us / steps,
                gpu_idle_fraction=1 - busy_us / span_us)


def kernel_table(device_events: list, steps: int, top: int = 15) -> dict:
    """Idle fraction, kernels and copies a step, and the `top` kernels by device time a step."""
    is_copy = [e.name.lower().startswith(("memcpy", "memset")) for e in device_events]
    kernels = [e for e, c in zip(device_events, is_copy) if not c]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e.name].append(e.time_range.end - e.time_range.start)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return dict(**idle_stats(device_events, steps), kernels_per_step=len(kernels) / steps,
                copies_per_step=(len(device_events) - len(kernels)) / steps,
                top_kernels=[dict(name=name[:90], us_per_step=sum(d) / steps, calls_per_step=len(d) / steps)
                             for name, d in ranked])


def trace_kernel_table(path: str, steps: int, top: int = 15) -> dict:
    """kernel_table of a Chrome trace written by LLMEngine.stop_profile (one rank's `steps` steps)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    device = [SimpleNamespace(name=e["name"], time_range=SimpleNamespace(start=e["ts"], end=e["ts"] + e["dur"]))
              for e in events if e.get("cat") in DEVICE_TRACE_CATEGORIES and e.get("ph") == "X"]
    return kernel_table(device, steps, top)
