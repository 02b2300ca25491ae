"""The W4A4 MXFP4 fused MoE from 1 to 512 tokens, every path: the expert-grouped GEMVs
(kernels_rocm.mxfp4_moe_expert_gemv) vs the decode path vs the grouped tl.dot GEMMs vs the bf16 fused
MoE, and the dispatch's own choice (no config), one GPU, one run. (Until 2026-11-27 it also timed an
int8 tensor-core path, removed after two forms measured slower everywhere: docs/benchmarks.md section 6.)

Kimi-K2.5's per-rank TP8 shape (E384, top-8, H7168, I256) and full width (I2048), uniform random
routing, MXFP4 activations (the released checkpoint's scheme). Timing and byte counts as
ci/bench_mxfp4.py (CUDA-graph replays, L2 flushed, medians; GB/s over the packed weights + scales
of the experts hit + x + out, as a fraction of the copy bandwidth measured in the same run). The
expert-GEMV rows are checked against the dequantize reference (relative error < 1e-2) at every T.
`--sweep` also times ExpertGemvConfig variants at a few T to choose the defaults. The decode path is timed up to --decode-max tokens (it
reads an expert once per pair: slow beyond). The summary names, per shape, the points that meet
issue 12's goals (>= 70% of copy from T = 32, >= 3x the bf16 MoE at T <= 32) with the dispatch.

Usage: python ci/bench_mxfp4_expert_gemv.py [--out DIR] [--sweep] [--tokens 32,64,128]
Writes bench_mxfp4_expert_gemv.json / .md to DIR (default $OUT or ./bench_out). Exit 1 if a check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "ci"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import triton  # noqa: E402

from bench_mxfp4 import (  # noqa: E402
    DEVICE, GOAL_MOE_FRACTION, GOAL_MOE_SPEEDUP, MOE_SHAPES, REL_TOL, MoeWeights, moe_call_inputs, moe_reference,
)
from gpu_timing import measure_copy_bandwidth, rel_error, time_graph  # noqa: E402
from kernels_rocm.fused_moe import fused_moe  # noqa: E402
from kernels_rocm.mxfp4_moe import default_config  # noqa: E402
from kernels_rocm.mxfp4_moe_decode import default_config as decode_default  # noqa: E402
from kernels_rocm.mxfp4_moe_expert_gemv import default_config as expert_default  # noqa: E402

TOKENS = (1, 4, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PATHS = ("expert_gemv", "decode", "grouped")  # the MXFP4 paths, by config type
CHECKED = ("expert_gemv",)  # the paths checked against the reference at every T
SWEEP_TOKENS = (32, 128, 512)
SWEEP = ([dict(block_m=b) for b in (2, 4, 8)] + [dict(gate_up_rows=r, down_rows=r) for r in (2, 8)]
         + [dict(gate_up_rows=8), dict(down_rows=8), dict(gate_up_k_lanes=16, down_k_lanes=16),
            dict(gate_up_warps=8), dict(down_warps=8)])


def _time_variants(weights, x, topk_weights, ids, out, base, variants, default_us, name, tokens) -> list[dict]:
    rows = []
    for variant in variants:
        cfg = dataclasses.replace(base, **variant)
        try:
            us = time_graph(lambda: weights.run(x, topk_weights, ids, True, config=cfg, out=out)) * 1e3
        except Exception as exc:  # a shape the compiler rejects (resources): report, go on
            us = float("nan")
            print(f"  sweep {cfg} FAILED {type(exc).__name__}", flush=True)
        rows.append({"shape": name, "tokens": tokens, "config": str(cfg), "us": us, "default_us": default_us})
    return rows


def bench(copy_gbps: float, sweep: bool, token_counts,
          decode_max: int) -> tuple[list[dict], list[dict], list[str]]:
    rows, sweep_rows, failures = [], [], []
    for name, shape in MOE_SHAPES.items():
        weights = MoeWeights(shape, with_bf16=True)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        for tokens in token_counts:
            x, topk_weights, ids, out, hit, num_bytes = moe_call_inputs(weights, tokens, gen)
            pairs = tokens * weights.top_k
            configs = {"expert_gemv": expert_default(pairs, weights.num_experts, weights.inter),
                       "grouped": default_config(tokens, weights.top_k, weights.num_experts, weights.hidden,
                                                 weights.inter, torch.device(DEVICE)),
                       "auto": None}
            if tokens <= decode_max:  # the decode path's launch shape at this T (what the dispatch runs)
                configs["decode"] = decode_default(tokens, weights.top_k, weights.hidden, weights.inter, True,
                                                   torch.device(DEVICE))
            row = {"shape": name, "tokens": tokens, "experts_hit": hit, "mb": num_bytes / 1e6,
                   "config": str(configs["expert_gemv"])}
            for label, cfg in configs.items():
                us = time_graph(lambda: weights.run(x, topk_weights, ids, True, config=cfg, out=out)) * 1e3
                row[f"{label}_us"] = us
                row[f"{label}_fraction"] = num_bytes / us / 1e3 / copy_gbps
            ref = moe_reference(x, weights.w13, weights.s13, weights.w2, weights.s2, topk_weights, ids, True)
            for label in CHECKED:
                got = weights.run(x, topk_weights, ids, True, config=configs[label])
                row[f"{label}_rel_err"] = err = rel_error(got, ref)
                if not err <= REL_TOL:
                    failures.append(f"{name} T={tokens} {label} rel err {err:.2e} > {REL_TOL}")
            w13_bf16, w2_bf16 = weights.bf16
            row["bf16_us"] = time_graph(lambda: fused_moe(x, w13_bf16, w2_bf16, topk_weights, ids, out=out)) * 1e3
            row["best"] = min((p for p in PATHS if f"{p}_us" in row), key=lambda p: row[f"{p}_us"])
            rows.append(row)
            print(f"  {name} T={tokens}: expert GEMV {row['expert_gemv_us']:.1f} us "
                  f"({row['expert_gemv_fraction'] * 100:.0f}% copy), grouped {row['grouped_us']:.1f}, "
                  f"decode {row.get('decode_us', float('nan')):.1f}, auto {row['auto_us']:.1f}, "
                  f"bf16 {row['bf16_us']:.1f}; err {row['expert_gemv_rel_err']:.1e}", flush=True)
            if sweep and tokens in SWEEP_TOKENS:
                sweep_rows += _time_variants(weights, x, topk_weights, ids, out, configs["expert_gemv"], SWEEP,
                                             row["expert_gemv_us"], name, tokens)
        del weights
        torch.cuda.empty_cache()
    return rows, sweep_rows, failures


def summarize(rows: list[dict]) -> list[str]:
    """Per shape: the T at which the dispatch (no config) meets each of issue 12's goals."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape]
        copy_goal = [r for r in mine if r["tokens"] >= 32]
        speed_goal = [r for r in mine if r["tokens"] <= 32]
        met_copy = [r["tokens"] for r in copy_goal if r["auto_fraction"] >= GOAL_MOE_FRACTION]
        met_speed = [r["tokens"] for r in speed_goal if r["bf16_us"] / r["auto_us"] >= GOAL_MOE_SPEEDUP]
        lines.append(f"{shape}: >= {GOAL_MOE_FRACTION:.0%} of copy at T = {met_copy or 'none'} of "
                     f"{[r['tokens'] for r in copy_goal]}; >= {GOAL_MOE_SPEEDUP:.0f}x bf16 at "
                     f"T = {met_speed or 'none'} of "
                     f"{[r['tokens'] for r in speed_goal]}; fastest path by T: "
                     + ", ".join(f"{r['tokens']}: {r['best']}" for r in mine))
    return lines


def to_markdown(results: dict) -> str:
    lines = [f"# MXFP4 MoE, W4A4, every path: {results['device']}", "",
             f"torch {results['torch']}, triton {results['triton']}, {results['date']}. Copy bandwidth: "
             f"**{results['copy']['gbps']:.0f} GB/s**. CUDA-graph replays, L2 flushed, medians. µs (% of copy).", "",
             "| shape | T | experts hit | MB | expert GEMV | decode | grouped GEMMs | bf16 fused MoE | "
             "dispatch | dispatch vs bf16 | rel err expert GEMV |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    cell = lambda r, k: f"{r[k + '_us']:.1f} ({r[k + '_fraction'] * 100:.0f}%)" if k + "_us" in r else "-"  # noqa: E731
    for r in results["rows"]:
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['experts_hit']} | {r['mb']:.0f} | "
                     f"{cell(r, 'expert_gemv')} | {cell(r, 'decode')} | {cell(r, 'grouped')} | {r['bf16_us']:.1f} | "
                     f"{cell(r, 'auto')} | {r['bf16_us'] / r['auto_us']:.2f}x | {r['expert_gemv_rel_err']:.1e} |")
    if results["sweep"]:
        lines += ["", "## Launch-shape sweep (µs; default in the last column)", "",
                  "| shape | T | config | µs | default µs |", "|---|---:|---|---:|---:|"]
        for r in results["sweep"]:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['config']} | {r['us']:.1f} | {r['default_us']:.1f} |")
    lines += ["", "## Summary", ""] + [f"- {s}" for s in results["summary"]]
    lines += ["", f"Correctness: {'; '.join(results['failures']) or 'every expert-GEMV row within 1e-2'}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    parser.add_argument("--sweep", action="store_true", help="time ExpertGemvConfig variants")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts to time")
    parser.add_argument("--decode-max", type=int, default=192, help="largest T at which the decode path is timed")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_mxfp4_expert_gemv: no CUDA/ROCm GPU available", file=sys.stderr)
        return 2
    start = time.time()
    copy = measure_copy_bandwidth()
    print(f"copy {copy['gbps']:.0f} GB/s", flush=True)
    rows, sweep_rows, failures = bench(copy["gbps"], args.sweep, [int(t) for t in args.tokens.split(",")],
                                       args.decode_max)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d"), "copy": copy, "rows": rows, "sweep": sweep_rows,
               "summary": summarize(rows), "failures": failures, "seconds": time.time() - start}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_mxfp4_expert_gemv.json").write_text(json.dumps(results, indent=2))
    (args.out / "bench_mxfp4_expert_gemv.md").write_text(to_markdown(results))
    print(to_markdown(results))
    print(f"{time.time() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
