"""Where the W4A4 MXFP4 MoE decode path's time goes, and its launch-shape variants, one GPU.

Kimi-K2.5's per-rank TP8 shape (E384, top-8, H7168, I256) and full width (I2048), uniform random
routing, MXFP4 activations; at ci/bench_mxfp4_expert_gemv.py's token counts the same inputs as that
bench (its generator, its order), other counts from a generator of their own. Per point:
- every variant of --variants (VARIANTS: the launch shape the dispatch picks at that T,
  mxfp4_moe_decode.default_config, changed one way; "before" = DecodeConfig()) and the
  expert-grouped GEMV path, each a CUDA-graph replay, L2 flushed, median (as ci/bench_mxfp4.py), and
  checked against the fp32 reference (relative error < 1e-2);
- with --timeline, a kernel timeline of the dispatch's shape from torch.profiler over graph replays
  (L2 flushed between them), with PDL and without: each launch's duration (without PDL the kernel
  alone; with PDL a kernel starts early and its duration includes its wait), the gaps between
  launches, the span first start - last end, and the call's time without PDL.
`--ncu` then runs itself under Nsight Compute (if found) for the kernels of --ncu-variants at TP8 T = 4
and 32 and full width T = 1 (duration, DRAM bytes and throughput, L2 bytes, instructions, issue
activity, occupancy, warp stall reasons; --clock-control none, caches flushed) into ncu.csv.

Usage: python ci/profile_mxfp4_decode.py [--out DIR] [--tokens "tp8:1,4;full:1"] [--timeline] [--ncu]
Writes profile_mxfp4_decode.json / .md (after every point) to DIR (default $OUT or ./bench_out).
Exit 1 if a check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "ci"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import triton  # noqa: E402

from bench_mxfp4 import DEVICE, MOE_SHAPES, REL_TOL, MoeWeights, moe_call_inputs, moe_reference  # noqa: E402
from gpu_timing import measure_copy_bandwidth, rel_error, time_graph  # noqa: E402
from bench_mxfp4_expert_gemv import TOKENS as BENCH_TOKENS  # noqa: E402
from kernels_rocm import _pdl as pdl  # noqa: E402
from kernels_rocm.mxfp4_moe_decode import DecodeConfig  # noqa: E402
from kernels_rocm.mxfp4_moe_decode import default_config as decode_default  # noqa: E402
from kernels_rocm.mxfp4_moe_expert_gemv import default_config as expert_default  # noqa: E402

OURS = ("_quantize_rows_kernel", "_gate_up_kernel", "_down_kernel")
# Variants: changes to the launch shape the dispatch picks at each T (mxfp4_moe_decode.default_config);
# "auto" is that shape, "before" the one fused_moe_mxfp4 took before it (DecodeConfig()).
VARIANTS = {
    "auto": {}, "before": None,
    "d_ahead2": dict(down_ahead=2), "d_ahead4": dict(down_ahead=4),
    "d_r2": dict(down_rows=2), "d_r2_ahead4": dict(down_rows=2, down_ahead=4),
    "d_r2_ahead8": dict(down_rows=2, down_ahead=8),
    "g_2rows": dict(gate_up_rows=2, gate_up_warps=4, gate_up_k_lanes=None),
    "g_2warps": dict(gate_up_rows=4, gate_up_warps=2, gate_up_k_lanes=None),
    "g_16rows": dict(gate_up_rows=4, gate_up_warps=4, gate_up_k_lanes=32),
}


def _variant(label: str, tokens: int, weights: MoeWeights) -> DecodeConfig:
    change = VARIANTS[label]
    if change is None:
        return DecodeConfig()
    auto = decode_default(tokens, weights.top_k, weights.hidden, weights.inter, True, torch.device(DEVICE))
    return dataclasses.replace(auto, **change)


def _timeline(graph: torch.cuda.CUDAGraph, flush: torch.Tensor, replays: int = 12) -> dict:
    """Median per-launch durations, gaps and span (µs) of our kernels over graph replays."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    runs, current = [], []
    for e in kernels:
        if e["name"].startswith(OURS):
            current.append(e)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    runs = [r for r in runs if len(r) == len(runs[-1])][1:]  # whole replays, the first dropped
    if not runs:
        return {}
    names = [e["name"].split("(")[0] for e in runs[0]]
    out = {"launches": [f"{i}:{n}" for i, n in enumerate(names)],
           "dur_us": [statistics.median(r[i]["dur"] for r in runs) for i in range(len(names))],
           "gap_us": [statistics.median(r[i]["ts"] - (r[i - 1]["ts"] + r[i - 1]["dur"]) for r in runs)
                      for i in range(1, len(names))],
           "span_us": statistics.median(r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"] for r in runs)}
    return out


def _graph(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _inputs(weights: MoeWeights, tokens: int):
    """ci/bench_mxfp4_expert_gemv.py's inputs at its token counts (its generator, its order), others
    from a generator of their own."""
    if tokens not in BENCH_TOKENS:
        return moe_call_inputs(weights, tokens, torch.Generator(device=DEVICE).manual_seed(100 + tokens))
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for t in BENCH_TOKENS[:BENCH_TOKENS.index(tokens) + 1]:
        call = moe_call_inputs(weights, t, gen)
    return call


def profile(copy_gbps: float, points: dict[str, list[int]], variants: list[str], timeline: bool,
            save) -> tuple[list[dict], list[str]]:
    """Rows and failures; `save(rows, failures)` after every row (a run cut short keeps them)."""
    rows, failures = [], []
    flush = torch.empty(64 << 20, dtype=torch.int32, device=DEVICE)  # 256 MB, as do_bench's
    for name, shape in MOE_SHAPES.items():
        weights = MoeWeights(shape, with_bf16=False)
        for tokens in points[name.split()[1].lower()]:
            x, topk_weights, ids, out, hit, num_bytes = _inputs(weights, tokens)
            row = {"shape": name, "tokens": tokens, "experts_hit": hit, "mb": num_bytes / 1e6}
            ref = moe_reference(x, weights.w13, weights.s13, weights.w2, weights.s2, topk_weights, ids, True)
            base_out = None
            pairs = tokens * weights.top_k
            configs = {label: _variant(label, tokens, weights) for label in variants}
            configs["expert_gemv"] = expert_default(pairs, weights.num_experts, weights.inter)
            for label, cfg in configs.items():
                run = lambda cfg=cfg, w=weights: w.run(x, topk_weights, ids, True, config=cfg, out=out)  # noqa: E731
                try:
                    us = time_graph(run) * 1e3
                except Exception as exc:  # a launch the compiler rejects: report, go on
                    failures.append(f"{name} T={tokens} {label}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                got = weights.run(x, topk_weights, ids, True, config=cfg).clone()
                err = rel_error(got, ref)
                if not err <= REL_TOL:
                    failures.append(f"{name} T={tokens} {label} rel err {err:.2e}")
                base_out = got if label == "auto" else base_out
                row[label] = {"us": us, "fraction": num_bytes / us / 1e3 / copy_gbps, "rel_err": err,
                              "diff_vs_default": None if base_out is None else rel_error(got, base_out)}
                row[label]["config"] = str(cfg)
                if label == "auto" and timeline:
                    row["timeline_pdl"] = _timeline(_graph(run), flush)
                    pdl.set_enabled(False)
                    row["default_no_pdl_us"] = time_graph(run) * 1e3
                    row["timeline_no_pdl"] = _timeline(_graph(run), flush)
                    pdl.set_enabled(True)
            rows.append(row)
            save(rows, failures)
            best = min((v for v in variants if v in row), key=lambda v: row[v]["us"])
            print(f"{name} T={tokens}: auto {row['auto']['us']:.1f} us ({row['auto']['fraction']:.0%}), "
                  f"expert GEMV {row['expert_gemv']['us']:.1f}; best {best} {row[best]['us']:.1f} "
                  f"({row[best]['fraction']:.0%})", flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows, failures


NCU_POINTS = (("Kimi TP8 E384 H7168 I256", 4), ("Kimi TP8 E384 H7168 I256", 32), ("Kimi full E384 H7168 I2048", 1))
NCU_METRICS = ("gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,"
               "lts__t_bytes.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,"
               "sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,"
               "launch__occupancy_limit_registers,smsp__warps_launched.sum")
NCU_SECTIONS = ("WarpStateStats", "SpeedOfLight")


def ncu_child(variants: list[str]) -> None:
    """Under ncu: one call per (point, variant), compiled and warmed outside the profiled range."""
    calls = []
    for name, tokens in NCU_POINTS:
        weights = MoeWeights(MOE_SHAPES[name], with_bf16=False)
        x, topk_weights, ids, out, _, _ = _inputs(weights, tokens)
        for label in variants:
            cfg = _variant(label, tokens, weights)
            weights.run(x, topk_weights, ids, True, config=cfg, out=out)
            calls.append((weights, x, topk_weights, ids, out, cfg))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for weights, x, topk_weights, ids, out, cfg in calls:
        weights.run(x, topk_weights, ids, True, config=cfg, out=out)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def run_ncu(out_dir: Path, variants: list[str]) -> str:
    ncu = shutil.which("ncu") or next(iter(sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))), None)
    if ncu is None:
        return "ncu not found"
    cmd = [str(ncu), "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page", "raw",
           "--metrics", NCU_METRICS] + [a for s in NCU_SECTIONS for a in ("--section", s)]
    cmd += [sys.executable, __file__, "--ncu-child", "--ncu-variants", ",".join(variants)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    (out_dir / "ncu.csv").write_text(result.stdout)
    return result.stderr[-3000:]


def to_markdown(results: dict) -> str:
    variants = [v for v in list(VARIANTS) + ["expert_gemv"] if any(v in r for r in results["rows"])]
    lines = [f"# W4A4 MoE decode path, profile and variants: {results['device']}", "",
             f"torch {results['torch']}, triton {results['triton']}, {results['date']}, copy "
             f"{results['copy']['gbps']:.0f} GB/s. µs (% of copy).", "",
             "| variant | " + " | ".join(f"{r['shape'].split()[1]} T={r['tokens']}" for r in results["rows"]) + " |",
             "|---|" + "---:|" * len(results["rows"])]
    for v in variants:
        cells = [f"{r[v]['us']:.1f} ({r[v]['fraction']:.0%})" if v in r else "-" for r in results["rows"]]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    timelines = [(r, key) for r in results["rows"] for key in ("timeline_no_pdl", "timeline_pdl") if key in r]
    if timelines:
        lines += ["", "## Timelines of the default launch (µs)", ""]
    for r, key in timelines:
        t = r[key]
        lines.append(f"- {r['shape']} T={r['tokens']} {key}: durations {[round(d, 1) for d in t.get('dur_us', [])]}, "
                     f"gaps {[round(g, 1) for g in t.get('gap_us', [])]}, span {t.get('span_us', 0):.1f}")
    lines += ["", f"Failures: {results['failures'] or 'none'}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    parser.add_argument("--tokens", default="tp8:1,4,16,32;full:1,4,16,32", help="T per shape")
    parser.add_argument("--timeline", action="store_true", help="torch.profiler timelines of the default launch")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--ncu", action="store_true")
    parser.add_argument("--ncu-variants", default="auto")
    parser.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ncu_child:
        ncu_child(args.ncu_variants.split(","))
        return 0
    start = time.time()
    copy = measure_copy_bandwidth()
    print(f"copy {copy['gbps']:.0f} GB/s", flush=True)
    variants = ["auto"] + [v for v in args.variants.split(",") if v != "auto"]
    points = {shape: [int(t) for t in ts.split(",")] for shape, ts in (p.split(":") for p in args.tokens.split(";"))}
    args.out.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict], failures: list[str]) -> dict:
        results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "date": time.strftime("%Y-%m-%d"), "copy": copy, "rows": rows, "failures": failures}
        (args.out / "profile_mxfp4_decode.json").write_text(json.dumps(results, indent=2))
        (args.out / "profile_mxfp4_decode.md").write_text(to_markdown(results))
        return results

    results = save(*profile(copy["gbps"], points, variants, args.timeline, save))
    print(to_markdown(results), flush=True)
    if args.ncu:
        print("ncu:", run_ncu(args.out, args.ncu_variants.split(",")), flush=True)
    print(f"{time.time() - start:.0f} s")
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
