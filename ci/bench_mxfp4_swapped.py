"""The MXFP4 MoE's grouped GEMMs, their usual form against the swapped form (issue 12), one GPU, one run.

Usual form: the decoded weights are each tl.dot's B operand (pairs on the MMA's M axis, mma.sync).
Swapped form (`MoeConfig.gate_up_swapped` / `down_swapped`): out^T = W @ a^T, the decoded weights the
A operand from registers (wgmma, 64 weight rows a warpgroup). W4A4: both forms read x QDQ'd once per
call (from 2026-11-27; the first run of this script timed the usual form still QDQ'ing each tile in GEMM 1).
Kimi-K2.5's per-rank TP8 shape (E384, top-8, H7168, I256) and full width (I2048), uniform random
routing, W4A4 (activations QDQ'd) and W4A16, T = 64..512 (the grouped path's range and below).
Timing and byte counts as ci/bench_mxfp4.py (CUDA-graph replays, each after a 256 MB read that
empties L2, medians; % of the copy bandwidth measured in the same run over the packed weights +
scales of the experts hit + x + out). Each swapped row is checked against the fp32 reference (T = 128) or the usual form.
Variants at a few T: GEMM 2 swapped alone, 128-row GEMM 2 tiles, 2 pipeline stages.

Usage: python ci/bench_mxfp4_swapped.py [--out DIR] [--tokens 64,128,256,512]
Writes bench_mxfp4_swapped.json / .md to DIR (default $OUT or ./bench_out). Exit 1 if a check fails.
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

from bench_mxfp4 import DEVICE, MOE_SHAPES, REL_TOL, MoeWeights, moe_call_inputs, moe_reference  # noqa: E402
from gpu_timing import measure_copy_bandwidth, rel_error, time_graph  # noqa: E402
from kernels_rocm.mxfp4_moe import MoeConfig, default_config  # noqa: E402

TOKENS = (64, 96, 128, 192, 256, 384, 512)
VARIANT_TOKENS = (128, 512)
REFERENCE_TOKENS = (128,)  # the fp32 reference is slow at full width; elsewhere swapped is checked against usual


def variants(base: MoeConfig) -> dict[str, MoeConfig]:
    swapped = dataclasses.replace(base, gate_up_swapped=True, down_swapped=True)
    return {
        "down swapped only": dataclasses.replace(base, down_swapped=True),
        "swapped, down 128 rows": dataclasses.replace(swapped, down=dataclasses.replace(base.down, block_n=128)),
        "swapped, 2 stages": dataclasses.replace(swapped, gate_up=dataclasses.replace(base.gate_up, num_stages=2),
                                                 down=dataclasses.replace(base.down, num_stages=2)),
    }


def bench(copy_gbps: float, token_counts) -> tuple[list[dict], list[str]]:
    rows, failures = [], []
    for name, shape in MOE_SHAPES.items():
        weights = MoeWeights(shape, with_bf16=False)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        for tokens in token_counts:
            x, topk_weights, ids, out, hit, num_bytes = moe_call_inputs(weights, tokens, gen)
            base = default_config(tokens, weights.top_k, weights.num_experts, weights.hidden, weights.inter,
                                  torch.device(DEVICE))
            configs = {"usual": base, "swapped": dataclasses.replace(base, gate_up_swapped=True, down_swapped=True)}
            if tokens in VARIANT_TOKENS:
                configs.update(variants(base))
            for quantize in (True, False):
                row = {"shape": name, "tokens": tokens, "quantize": quantize, "experts_hit": hit, "mb": num_bytes / 1e6,
                       "config": str(base)}
                for label, cfg in configs.items():
                    if quantize is False and label not in ("usual", "swapped"):
                        continue
                    try:
                        us = time_graph(lambda: weights.run(x, topk_weights, ids, quantize, config=cfg, out=out)) * 1e3
                    except Exception as exc:  # a shape the compiler rejects (resources): report, go on
                        print(f"  {label} FAILED {type(exc).__name__}: {exc}", flush=True)
                        us = float("nan")
                    row[f"{label}_us"] = us
                    row[f"{label}_fraction"] = num_bytes / us / 1e3 / copy_gbps
                ref = (moe_reference(x, weights.w13, weights.s13, weights.w2, weights.s2, topk_weights, ids, quantize)
                       if tokens in REFERENCE_TOKENS else weights.run(x, topk_weights, ids, quantize, config=base))
                row["swapped_against"] = "fp32 reference" if tokens in REFERENCE_TOKENS else "usual form"
                row["swapped_rel_err"] = err = rel_error(
                    weights.run(x, topk_weights, ids, quantize, config=configs["swapped"]), ref)
                if not err <= REL_TOL:
                    failures.append(f"{name} T={tokens} quantize={quantize} swapped rel err {err:.2e} > {REL_TOL}")
                rows.append(row)
                extra = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in row.items()
                                  if k.endswith("_us") and k not in ("usual_us", "swapped_us"))
                print(f"  {name} T={tokens} {'W4A4' if quantize else 'W4A16'}: usual {row['usual_us']:.1f} us "
                      f"({row['usual_fraction'] * 100:.0f}%), swapped {row['swapped_us']:.1f} us "
                      f"({row['swapped_fraction'] * 100:.0f}%) err {err:.1e}; {extra}", flush=True)
        del weights
        torch.cuda.empty_cache()
    return rows, failures


def to_markdown(results: dict) -> str:
    lines = [f"# MXFP4 MoE grouped GEMMs, usual vs swapped form: {results['device']}", "",
             f"torch {results['torch']}, triton {results['triton']}, {results['date']}. Copy bandwidth "
             f"**{results['copy']['gbps']:.0f} GB/s**. CUDA-graph replays after a 256 MB read, medians. µs (% of copy).", "",
             "| shape | T | acts | experts hit | MB | usual | swapped | swapped / usual | rel err | variants |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for r in results["rows"]:
        extra = "; ".join(f"{k[:-3]} {v:.1f}" for k, v in r.items()
                          if k.endswith("_us") and k not in ("usual_us", "swapped_us"))
        lines.append(f"| {r['shape']} | {r['tokens']} | {'W4A4' if r['quantize'] else 'W4A16'} | {r['experts_hit']} | "
                     f"{r['mb']:.0f} | {r['usual_us']:.1f} ({r['usual_fraction'] * 100:.0f}%) | "
                     f"{r['swapped_us']:.1f} ({r['swapped_fraction'] * 100:.0f}%) | "
                     f"{r['swapped_us'] / r['usual_us']:.3f} | {r['swapped_rel_err']:.1e} | {extra} |")
    lines += ["", f"Correctness: {'; '.join(results['failures']) or 'every swapped row within 1e-2'}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts to time")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_mxfp4_swapped: no CUDA GPU available", file=sys.stderr)
        return 2
    start = time.time()
    copy = measure_copy_bandwidth()
    print(f"copy {copy['gbps']:.0f} GB/s", flush=True)
    rows, failures = bench(copy["gbps"], [int(t) for t in args.tokens.split(",")])
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d"), "copy": copy, "rows": rows, "failures": failures,
               "seconds": time.time() - start}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_mxfp4_swapped.json").write_text(json.dumps(results, indent=2))
    (args.out / "bench_mxfp4_swapped.md").write_text(to_markdown(results))
    print(to_markdown(results))
    print(f"{time.time() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
