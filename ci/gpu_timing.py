"""How the GPU benchmarks time kernels and what they compare against: CUDA-graph replays with L2
emptied between repetitions, the copy bandwidth measured in the same run, relative errors against a
reference, saved kernel versions loaded for A/B runs, and the header every A/B result starts with."""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from triton.testing import do_bench

WARMUP_MS, REP_MS = 10, 60

# How L2 is emptied between timed repetitions (ci/bench_mxfp4.py --flush): "read" (default), a 256 MB
# read that leaves clean lines, as a decode step finds L2 after the kernels before it read their
# weights and KV (they write only activations); or "zero", triton's do_bench, a 256 MB memset that
# leaves up to 50 MB of dirty lines for the timed call to write back while it reads. Measured on one
# H100 (docs/benchmarks.md section 6, 2026-11-27): "zero" made the 94 MB W4A4 MoE call at Kimi TP8
# T = 4 21% slower (54.2 against 44.8 us; bf16's 157 MB call 6%), 12% at 173 MB, 4% at 545 MB, < 1% from 1 GB.
FLUSH = "read"
READ_FLUSH_REPS = 50


def time_graph(fn: Callable[[], object]) -> float:
    """Median ms of one `fn()` replayed from a CUDA graph (L2 emptied between repetitions, FLUSH)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles every kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    if FLUSH == "zero":
        ms = do_bench(graph.replay, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
    else:
        ms = _median_after_reads(graph.replay)
    del graph
    return ms


def _median_after_reads(run: Callable[[], object]) -> float:
    """Median ms of `run()`, each repetition after a 256 MB read (L2 then holds clean lines only)."""
    flush = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
    flush.sum()  # the ones' dirty lines written back once, before anything is timed
    run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(READ_FLUSH_REPS)]
    for start, end in events:
        flush.sum()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return times[len(times) // 2]


def measure_copy_bandwidth(num_bytes: int = 4 << 30) -> dict:
    """Device-to-device copy of `num_bytes`; GB/s counts bytes read + written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": 2 * num_bytes, "ms": ms, "gbps": 2 * num_bytes / ms / 1e6}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def load_kernel_version(path: Path, name: str, package: str = "kernels_rocm"):
    """A saved version of a module of `package` (`git show main:kernels_rocm/x.py > file`) loaded as
    <package>.<name>, for A/B runs against this tree's: its package imports resolve, and its
    dataclasses find their module in sys.modules."""
    spec = importlib.util.spec_from_file_location(f"{package}.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def ab_header(baseline: Path) -> dict:
    """The start of an A/B result: device, torch, date, the copy bandwidth measured now (printed)
    and the saved version it ran against."""
    copy = measure_copy_bandwidth()
    print(f"copy {copy['gbps']:.0f} GB/s", flush=True)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "copy": copy, "baseline": str(baseline)}
