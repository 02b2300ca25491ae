"""The MXFP4 fused MoE at decode sizes: the GEMV-style decode path (kernels_rocm.mxfp4_moe_decode)
vs the grouped-GEMM path (forced with its MoeConfig) vs the bf16 fused MoE, one GPU, one run.

Kimi-K2.5's per-rank TP8 shape (E384, top-8, H7168, I256) and full width (I2048), T = 1, 2, 4,
8, 16, 32 tokens (--tokens), uniform random routing, W4A16 and W4A4 (activations quantized to
codes, integer dots). Timing and byte
counts as ci/bench_mxfp4.py (CUDA-graph replays, L2 flushed, medians; GB/s over the packed
weights + scales of the experts hit + x + out, as a fraction of the copy bandwidth measured in
the same run). Every decode-path row is checked against the dequantize reference (relative
error) at T = 1 and 8. `--sweep` also times DecodeConfig variants (one kernel's launch shape
changed at a time) at T = 1 and 4, to choose the defaults. The summary line per shape names the
largest T at which the decode path is faster than the grouped path in both modes (the evidence
for mxfp4_moe.decode_max_tokens).

Usage: python ci/bench_mxfp4_decode.py [--out DIR] [--sweep] [--tokens 1,2,4]   (about 1 minute on an H100; --sweep
adds about 2). Writes bench_mxfp4_decode.json / .md to DIR (default $OUT or ./bench_out), prints
the table. Exit 1 if a correctness check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "ci"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import triton  # noqa: E402

from bench_mxfp4 import DEVICE, MOE_SHAPES, REL_TOL, MoeWeights, moe_call_inputs, moe_reference  # noqa: E402
from gpu_timing import measure_copy_bandwidth, rel_error, time_graph  # noqa: E402
from kernels_rocm.fused_moe import fused_moe  # noqa: E402
from kernels_rocm.mxfp4_moe import decode_max_tokens, default_config  # noqa: E402
from kernels_rocm.mxfp4_moe_decode import DecodeConfig  # noqa: E402

TOKENS = (1, 2, 4, 8, 16, 32)  # --tokens 48,64,96,128 for where W4A4's decode and grouped paths cross
CHECK_TOKENS = (1, 8)
SWEEP_TOKENS = (1, 4)
SWEEP = [dict(gate_up_rows=r, gate_up_warps=w) for r, w in ((1, 4), (4, 4), (2, 2), (2, 8), (4, 8), (1, 8), (4, 2))]
SWEEP += [dict(down_rows=r, down_warps=w) for r, w in ((1, 4), (4, 4), (2, 2), (2, 8), (1, 8), (4, 2))]


def bench(copy_gbps: float, sweep: bool,
          token_counts: tuple[int, ...] = TOKENS) -> tuple[list[dict], list[dict], list[str]]:
    rows, sweep_rows, failures = [], [], []
    for name, shape in MOE_SHAPES.items():
        weights = MoeWeights(shape, with_bf16=True)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        for tokens in token_counts:
            x, topk_weights, ids, out, hit, num_bytes = moe_call_inputs(weights, tokens, gen)
            grouped = default_config(tokens, weights.top_k, weights.num_experts, weights.hidden, weights.inter,
                                     torch.device(DEVICE))
            decode = DecodeConfig()
            row = {"shape": name, "tokens": tokens, "inter": weights.inter, "experts_hit": hit, "mb": num_bytes / 1e6}
            for quantize, mode in ((False, "w4a16"), (True, "w4a4")):
                for label, cfg in (("decode", decode), ("grouped", grouped)):
                    us = time_graph(lambda: weights.run(x, topk_weights, ids, quantize, config=cfg, out=out)) * 1e3
                    row[f"{mode}_{label}_us"] = us
                    row[f"{mode}_{label}_fraction"] = num_bytes / us / 1e3 / copy_gbps
                err = None
                if tokens in CHECK_TOKENS:
                    ref = moe_reference(x, weights.w13, weights.s13, weights.w2, weights.s2, topk_weights, ids, quantize)
                    err = rel_error(weights.run(x, topk_weights, ids, quantize, config=decode), ref)
                    if not err <= REL_TOL:
                        failures.append(f"{name} T={tokens} {mode} decode path rel err {err:.2e} > {REL_TOL}")
                row[f"{mode}_decode_rel_err"] = err
            w13_bf16, w2_bf16 = weights.bf16
            row["bf16_us"] = time_graph(lambda: fused_moe(x, w13_bf16, w2_bf16, topk_weights, ids, out=out)) * 1e3
            rows.append(row)
            print(f"  {name} T={tokens}: W4A16 decode {row['w4a16_decode_us']:.1f} us "
                  f"({row['w4a16_decode_fraction'] * 100:.0f}% copy) grouped {row['w4a16_grouped_us']:.1f}; "
                  f"W4A4 decode {row['w4a4_decode_us']:.1f} grouped {row['w4a4_grouped_us']:.1f}; "
                  f"bf16 {row['bf16_us']:.1f} us", flush=True)
            if sweep and tokens in SWEEP_TOKENS:
                for variant in SWEEP:
                    cfg = DecodeConfig(**{**asdict(decode), **variant})
                    for quantize, mode in ((False, "w4a16"), (True, "w4a4")):
                        try:
                            us = time_graph(lambda: weights.run(x, topk_weights, ids, quantize, config=cfg, out=out)) * 1e3
                        except Exception as exc:  # a shape the compiler rejects (resources): report, go on
                            us = float("nan")
                            print(f"  sweep {cfg} FAILED {type(exc).__name__}", flush=True)
                        sweep_rows.append({"shape": name, "tokens": tokens, "mode": mode, "config": str(cfg), "us": us,
                                           "default_us": row[f"{mode}_decode_us"]})
        del weights
        torch.cuda.empty_cache()
    return rows, sweep_rows, failures


def summarize(rows: list[dict]) -> list[str]:
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        faster = [r["tokens"] for r in rows if r["shape"] == shape
                  and r["w4a16_decode_us"] < r["w4a16_grouped_us"] and r["w4a4_decode_us"] < r["w4a4_grouped_us"]]
        one = next(r for r in rows if r["shape"] == shape and r["tokens"] == 1)
        lines.append(f"{shape}: decode path faster than grouped (both modes) at T = {faster or 'none'}; "
                     f"decode_max_tokens W4A16 / W4A4 = {decode_max_tokens(one['inter'], False)} / "
                     f"{decode_max_tokens(one['inter'], True)}; "
                     f"T=1 W4A16 {one['w4a16_grouped_us'] / one['w4a16_decode_us']:.2f}x, "
                     f"W4A4 {one['w4a4_grouped_us'] / one['w4a4_decode_us']:.2f}x the grouped path, "
                     f"{one['bf16_us'] / one['w4a16_decode_us']:.2f}x the bf16 MoE (W4A16)")
    return lines


def to_markdown(results: dict) -> str:
    lines = [f"# MXFP4 MoE decode path: {results['device']}", "",
             f"torch {results['torch']}, triton {results['triton']}, {results['date']}. Copy bandwidth: "
             f"**{results['copy']['gbps']:.0f} GB/s**. CUDA-graph replays, L2 flushed, medians.", "",
             "| shape | T | experts hit | MB | W4A16 decode µs | % copy | grouped µs | % copy | W4A4 decode µs | % copy | "
             "grouped µs | % copy | bf16 µs | rel err W4A16 / W4A4 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.1e}"  # noqa: E731
    for r in results["rows"]:
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['experts_hit']} | {r['mb']:.0f} | {r['w4a16_decode_us']:.1f} | "
            f"{r['w4a16_decode_fraction'] * 100:.0f}% | {r['w4a16_grouped_us']:.1f} | {r['w4a16_grouped_fraction'] * 100:.0f}% | "
            f"{r['w4a4_decode_us']:.1f} | {r['w4a4_decode_fraction'] * 100:.0f}% | {r['w4a4_grouped_us']:.1f} | "
            f"{r['w4a4_grouped_fraction'] * 100:.0f}% | {r['bf16_us']:.1f} | {fmt(r['w4a16_decode_rel_err'])} / "
            f"{fmt(r['w4a4_decode_rel_err'])} |")
    if results["sweep"]:
        lines += ["", "## DecodeConfig sweep (µs; default in the last column)", "",
                  "| shape | T | mode | config | µs | default µs |", "|---|---:|---|---|---:|---:|"]
        for r in results["sweep"]:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['mode']} | {r['config']} | {r['us']:.1f} | {r['default_us']:.1f} |")
    lines += ["", "## Summary", ""] + [f"- {s}" for s in results["summary"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    parser.add_argument("--sweep", action="store_true", help="time DecodeConfig variants at T = 1 and 4")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts to time")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_mxfp4_decode: no CUDA/ROCm GPU available", file=sys.stderr)
        return 2
    start = time.time()
    copy = measure_copy_bandwidth()
    print(f"copy {copy['gbps']:.0f} GB/s", flush=True)
    rows, sweep_rows, failures = bench(copy["gbps"], args.sweep, tuple(int(t) for t in args.tokens.split(",")))
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d"), "copy": copy, "rows": rows, "sweep": sweep_rows,
               "summary": summarize(rows) + (failures or ["correctness: all checks passed"]),
               "failures": failures, "seconds": time.time() - start}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_mxfp4_decode.json").write_text(json.dumps(results, indent=2))
    (args.out / "bench_mxfp4_decode.md").write_text(to_markdown(results))
    print(to_markdown(results))
    print(f"{time.time() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
