"""The W4A4 MXFP4 fused MoE from a few dozen to 512 tokens: the expert-grouped GEMV path
(kernels_rocm.mxfp4_moe_expert_gemv) vs the decode path vs the grouped tl.dot GEMMs vs the bf16
fused MoE, one GPU, one run.

Kimi-K2.5's per-rank TP8 shape (E384, top-8, H7168, I256) and full width (I2048), uniform random
routing, MXFP4 activations (the released checkpoint's scheme). Timing and byte counts as
ci/bench_mxfp4.py (CUDA-graph replays, L2 flushed, medians; GB/s over the packed weights + scales
of the experts hit + x + out, as a fraction of the copy bandwidth measured in the same run). The
expert-GEMV rows are checked against the dequantize reference (relative error < 1e-2) at every T.
`--sweep` also times ExpertGemvConfig variants (pairs a block, rows a lane, lanes along K, warps)
at a few T to choose the defaults. The decode path is timed up to --decode-max tokens (it reads
an expert once per pair: slow beyond).

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
    DEVICE, MOE_SHAPES, REL_TOL, MoeWeights, measure_copy_bandwidth, moe_call_inputs, moe_reference, rel_error, time_graph,
)
from kernels_rocm.fused_moe import fused_moe  # noqa: E402
from kernels_rocm.mxfp4_moe import default_config  # noqa: E402
from kernels_rocm.mxfp4_moe_decode import DecodeConfig  # noqa: E402
from kernels_rocm.mxfp4_moe_expert_gemv import default_config as expert_default  # noqa: E402

TOKENS = (16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 384, 512)
SWEEP_TOKENS = (64, 128, 256)
SWEEP = ([dict(block_m=b) for b in (2, 4, 8)] + [dict(gate_up_rows=r, down_rows=r) for r in (2, 8)]
         + [dict(gate_up_rows=8), dict(down_rows=8), dict(gate_up_k_lanes=16, down_k_lanes=16),
            dict(gate_up_warps=8), dict(down_warps=8)])


def bench(copy_gbps: float, sweep: bool, token_counts, decode_max: int) -> tuple[list[dict], list[dict], list[str]]:
    rows, sweep_rows, failures = [], [], []
    for name, shape in MOE_SHAPES.items():
        weights = MoeWeights(shape, with_bf16=True)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        for tokens in token_counts:
            x, topk_weights, ids, out, hit, num_bytes = moe_call_inputs(weights, tokens, gen)
            expert = expert_default(tokens * weights.top_k, weights.num_experts, weights.inter)
            configs = {"expert_gemv": expert,
                       "grouped": default_config(tokens, weights.top_k, weights.num_experts, weights.hidden,
                                                 weights.inter, torch.device(DEVICE))}
            if tokens <= decode_max:
                configs["decode"] = DecodeConfig()
            row = {"shape": name, "tokens": tokens, "experts_hit": hit, "mb": num_bytes / 1e6, "config": str(expert)}
            for label, cfg in configs.items():
                us = time_graph(lambda: weights.run(x, topk_weights, ids, True, config=cfg, out=out)) * 1e3
                row[f"{label}_us"] = us
                row[f"{label}_fraction"] = num_bytes / us / 1e3 / copy_gbps
            ref = moe_reference(x, weights.w13, weights.s13, weights.w2, weights.s2, topk_weights, ids, True)
            row["rel_err"] = err = rel_error(weights.run(x, topk_weights, ids, True, config=expert), ref)
            if not err <= REL_TOL:
                failures.append(f"{name} T={tokens} expert GEMV rel err {err:.2e} > {REL_TOL}")
            w13_bf16, w2_bf16 = weights.bf16
            row["bf16_us"] = time_graph(lambda: fused_moe(x, w13_bf16, w2_bf16, topk_weights, ids, out=out)) * 1e3
            rows.append(row)
            print(f"  {name} T={tokens}: expert GEMV {row['expert_gemv_us']:.1f} us "
                  f"({row['expert_gemv_fraction'] * 100:.0f}% copy), grouped {row['grouped_us']:.1f}, "
                  f"decode {row.get('decode_us', float('nan')):.1f}, bf16 {row['bf16_us']:.1f}; err {err:.1e}",
                  flush=True)
            if sweep and tokens in SWEEP_TOKENS:
                for variant in SWEEP:
                    cfg = dataclasses.replace(expert, **variant)
                    try:
                        us = time_graph(lambda: weights.run(x, topk_weights, ids, True, config=cfg, out=out)) * 1e3
                    except Exception as exc:  # a shape the compiler rejects (resources): report, go on
                        us = float("nan")
                        print(f"  sweep {cfg} FAILED {type(exc).__name__}", flush=True)
                    sweep_rows.append({"shape": name, "tokens": tokens, "config": str(cfg), "us": us,
                                       "default_us": row["expert_gemv_us"]})
        del weights
        torch.cuda.empty_cache()
    return rows, sweep_rows, failures


def to_markdown(results: dict) -> str:
    lines = [f"# MXFP4 MoE, W4A4, expert-grouped GEMV path: {results['device']}", "",
             f"torch {results['torch']}, triton {results['triton']}, {results['date']}. Copy bandwidth: "
             f"**{results['copy']['gbps']:.0f} GB/s**. CUDA-graph replays, L2 flushed, medians. µs (% of copy).", "",
             "| shape | T | experts hit | MB | expert GEMV | decode | grouped GEMMs | bf16 fused MoE | vs grouped | "
             "vs bf16 | rel err |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    cell = lambda r, k: f"{r[k + '_us']:.1f} ({r[k + '_fraction'] * 100:.0f}%)" if k + "_us" in r else "-"  # noqa: E731
    for r in results["rows"]:
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['experts_hit']} | {r['mb']:.0f} | {cell(r, 'expert_gemv')} | "
                     f"{cell(r, 'decode')} | {cell(r, 'grouped')} | {r['bf16_us']:.1f} | "
                     f"{r['grouped_us'] / r['expert_gemv_us']:.2f}x | {r['bf16_us'] / r['expert_gemv_us']:.2f}x | "
                     f"{r['rel_err']:.1e} |")
    if results["sweep"]:
        lines += ["", "## ExpertGemvConfig sweep (µs; default in the last column)", "",
                  "| shape | T | config | µs | default µs |", "|---|---:|---|---:|---:|"]
        for r in results["sweep"]:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['config']} | {r['us']:.1f} | {r['default_us']:.1f} |")
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
               "failures": failures, "seconds": time.time() - start}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_mxfp4_expert_gemv.json").write_text(json.dumps(results, indent=2))
    (args.out / "bench_mxfp4_expert_gemv.md").write_text(to_markdown(results))
    print(to_markdown(results))
    print(f"{time.time() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
