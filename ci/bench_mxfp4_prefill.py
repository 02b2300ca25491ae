"""MXFP4 GEMMs and the MoE alignment at prefill sizes, each against the choice it replaced (issues 12, 21): W4A4
grouped MoE with `mxfp4_moe.prefill_config` against the small-M tiles, the dense MXFP4 linear's WIDE_TILES against
its small-M tiles, and `moe_align_block_size`'s three kernels against its one program. Part `fold`: the grouped MoE
(T = 128 .. 8192) and the dense linear with each E8M0 scale folded into the decode's multiply (`fold_scales`, what
the layers pass for weights whose scales fold) against the separate scale multiply, W4A4 and W4A16. The replaced
choices are taken by switching the new ones off (a module constant or the weights' flag, patched) in the same
process. CUDA graphs, L2 emptied by reads between replays (ci/gpu_timing), medians; outputs checked against each
other (the fold: bit for bit).

    python ci/bench_mxfp4_prefill.py [--out DIR] [--quick] [--parts moe,linear,align,fold]
    (writes DIR/bench_mxfp4_prefill.json)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_rocm.fused_moe as fused_moe_mod  # noqa: E402
import kernels_rocm.mxfp4_linear as linear_mod  # noqa: E402
import kernels_rocm.mxfp4_moe as moe_mod  # noqa: E402
from bench_mxfp4 import MOE_SHAPES, MoeWeights, moe_call_inputs, random_mxfp4, routing  # noqa: E402
from kernels_rocm._mxfp4 import foldable_scales  # noqa: E402
from gpu_timing import measure_copy_bandwidth, rel_error, time_graph  # noqa: E402

LINEAR_SHAPES = {"dense gate_up TP8": (4608, 7168), "dense down TP8": (7168, 2304), "shared gate_up TP8": (512, 7168)}


def both(switch_off, run) -> dict:
    """run() timed (µs) with the new choice, then with `switch_off()` (a module constant patched back) applied."""
    new, out_new = time_graph(run) * 1e3, run()
    with switch_off():
        old, out_old = time_graph(run) * 1e3, run()
    return dict(new_us=new, old_us=old, speedup=old / new, rel_err=rel_error(out_new.float(), out_old.float()),
                bitwise_equal=bool(torch.equal(out_new, out_old)))


def bench_moe_shape(name: str, shape: tuple, tokens, gen: torch.Generator) -> list[dict]:
    weights = MoeWeights(shape, with_bf16=False)
    experts, top_k, hidden, inter = shape
    rows = []
    for t in tokens:
        x = torch.randn(t, hidden, generator=gen, device="cuda").bfloat16()
        topk_weights, ids = routing(t, experts, top_k, gen)
        row = both(lambda: mock.patch.object(moe_mod, "PREFILL_PAIRS_PER_EXPERT", 10**9),
                   lambda: weights.run(x, topk_weights, ids, True))
        rows.append(dict(shape=name, tokens=t, tflops=t * top_k * 3 * hidden * inter * 2 / row["new_us"] / 1e6, **row))
        print(f"moe {name} T={t}: {row['old_us']:.0f} -> {row['new_us']:.0f} us ({row['speedup']:.2f}x)", flush=True)
    return rows


def bench_fold(gen: torch.Generator, copy_gbps: float) -> list[dict]:
    """Grouped MoE and dense linear, scales folded into the decode's multiply or not (W4A4 and W4A16)."""
    rows = []
    for name, shape in MOE_SHAPES.items():
        weights = MoeWeights(shape, with_bf16=False)
        assert weights.fold, "bench_mxfp4.random_mxfp4's scale bytes fold"
        for t in (128, 256, 512, 2048, 8192) if "TP8" in name else (256, 512, 8192):
            x, topk_weights, ids, _, _, num_bytes = moe_call_inputs(weights, t, gen)
            for quantize in (True, False):
                row = both(lambda: mock.patch.object(weights, "fold", False),
                           lambda: weights.run(x, topk_weights, ids, quantize))
                gbps = num_bytes / row["new_us"] / 1e3
                rows.append(dict(kind="moe", shape=name, tokens=t, quantize=quantize, fraction_of_copy=gbps / copy_gbps,
                                 old_fraction_of_copy=num_bytes / row["old_us"] / 1e3 / copy_gbps, **row))
                print(f"fold moe {name} T={t} {'w4a4' if quantize else 'w4a16'}: {row['old_us']:.0f} -> "
                      f"{row['new_us']:.0f} us ({row['speedup']:.3f}x, {100 * gbps / copy_gbps:.0f}% of copy), "
                      f"bit for bit {row['bitwise_equal']}", flush=True)
        torch.cuda.empty_cache()
    for name, (n, k) in LINEAR_SHAPES.items():
        w, s = random_mxfp4(n, k, g=gen)
        fold = foldable_scales(s)
        for m in (256, 2048, 8192):
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
            flags = dict(fold=fold)
            row = both(lambda: mock.patch.dict(flags, fold=False),
                       lambda: linear_mod.mxfp4_linear(x, w, s, quantize_activations=True, fold_scales=flags["fold"]))
            rows.append(dict(kind="linear", shape=name, tokens=m, quantize=True, **row))
            print(f"fold linear {name} M={m}: {row['old_us']:.0f} -> {row['new_us']:.0f} us ({row['speedup']:.3f}x), "
                  f"bit for bit {row['bitwise_equal']}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    ap.add_argument("--quick", action="store_true", help="T = 2048 and 8192 only")
    ap.add_argument("--parts", default="moe,linear,align,fold")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_mxfp4_prefill: no CUDA/ROCm GPU available", file=sys.stderr)
        return 2
    parts = set(args.parts.split(","))
    result = dict(device=torch.cuda.get_device_name(), copy=measure_copy_bandwidth(), moe=[], linear=[], align=[],
                  fold=[])
    tokens = (2048, 8192) if args.quick else (512, 1024, 2048, 4096, 8192)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, shape in MOE_SHAPES.items() if "moe" in parts else ():
        result["moe"] += bench_moe_shape(name, shape, tokens if "TP8" in name else (1024, 8192), gen)
        torch.cuda.empty_cache()
    for name, (n, k) in LINEAR_SHAPES.items() if "linear" in parts else ():
        w, s = random_mxfp4(n, k, g=gen)
        for m in (64, 256, 512, 2048, 8192):
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
            row = both(lambda: mock.patch.object(linear_mod, "WIDE_TILES", ()),
                       lambda: linear_mod.mxfp4_linear(x, w, s, quantize_activations=True))
            result["linear"].append(dict(shape=name, m=m, **row))
            print(f"linear {name} M={m}: {row['old_us']:.0f} -> {row['new_us']:.0f} us ({row['speedup']:.2f}x)", flush=True)
    for t in (64, 512, 1024, 2048, 8192, 16384) if "align" in parts else ():
        ids = torch.rand(t, 384, generator=gen, device="cuda").topk(8, dim=-1).indices.to(torch.int32)
        row = both(lambda: mock.patch.object(fused_moe_mod, "ALIGN_PARALLEL_PAIRS", 10**9),
                   lambda: fused_moe_mod.moe_align_block_size(ids, 384, 64)[2])
        result["align"].append(dict(pairs=t * 8, **row))
        print(f"align {t * 8} pairs: {row['old_us']:.1f} -> {row['new_us']:.1f} us", flush=True)
    if "fold" in parts:
        result["fold"] = bench_fold(gen, result["copy"]["gbps"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_mxfp4_prefill.json").write_text(json.dumps(result, indent=1))
    bad = [r for part in ("moe", "linear", "align") for r in result[part] if r["rel_err"] > 1e-2]
    bad += [r for r in result["fold"] if not r["bitwise_equal"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
