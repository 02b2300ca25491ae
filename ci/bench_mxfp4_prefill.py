"""MXFP4 GEMMs and the MoE alignment at prefill sizes, each against the choice it replaced (issues 12, 21): W4A4
grouped MoE with `mxfp4_moe.prefill_config` against the small-M tiles, the dense MXFP4 linear's WIDE_TILES against
its small-M tiles, and `moe_align_block_size`'s three kernels against its one program. The replaced choices are
taken by switching the new ones off (their module constants) in the same process. CUDA graphs, L2 emptied by
reads between replays (ci/gpu_timing), medians; outputs checked against each other.

    python ci/bench_mxfp4_prefill.py [--out DIR] [--quick]        (writes DIR/bench_mxfp4_prefill.json)
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
from bench_mxfp4 import MOE_SHAPES, MoeWeights, random_mxfp4, routing  # noqa: E402
from gpu_timing import measure_copy_bandwidth, rel_error, time_graph  # noqa: E402

LINEAR_SHAPES = {"dense gate_up TP8": (4608, 7168), "dense down TP8": (7168, 2304), "shared gate_up TP8": (512, 7168)}


def both(switch_off, run) -> dict:
    """run() timed (µs) with the new choice, then with `switch_off()` (a module constant patched back) applied."""
    new, out_new = time_graph(run) * 1e3, run().float()
    with switch_off():
        old, out_old = time_graph(run) * 1e3, run().float()
    return dict(new_us=new, old_us=old, speedup=old / new, rel_err=rel_error(out_new, out_old))


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    ap.add_argument("--quick", action="store_true", help="T = 2048 and 8192 only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_mxfp4_prefill: no CUDA/ROCm GPU available", file=sys.stderr)
        return 2
    result = dict(device=torch.cuda.get_device_name(), copy=measure_copy_bandwidth(), moe=[], linear=[], align=[])
    tokens = (2048, 8192) if args.quick else (512, 1024, 2048, 4096, 8192)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, shape in MOE_SHAPES.items():
        result["moe"] += bench_moe_shape(name, shape, tokens if "TP8" in name else (1024, 8192), gen)
        torch.cuda.empty_cache()
    for name, (n, k) in LINEAR_SHAPES.items():
        w, s = random_mxfp4(n, k, g=gen)
        for m in (64, 256, 512, 2048, 8192):
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
            row = both(lambda: mock.patch.object(linear_mod, "WIDE_TILES", ()),
                       lambda: linear_mod.mxfp4_linear(x, w, s, quantize_activations=True))
            result["linear"].append(dict(shape=name, m=m, **row))
            print(f"linear {name} M={m}: {row['old_us']:.0f} -> {row['new_us']:.0f} us ({row['speedup']:.2f}x)", flush=True)
    for t in (64, 512, 1024, 2048, 8192, 16384):
        ids = torch.rand(t, 384, generator=gen, device="cuda").topk(8, dim=-1).indices.to(torch.int32)
        row = both(lambda: mock.patch.object(fused_moe_mod, "ALIGN_PARALLEL_PAIRS", 10**9),
                   lambda: fused_moe_mod.moe_align_block_size(ids, 384, 64)[2])
        result["align"].append(dict(pairs=t * 8, **row))
        print(f"align {t * 8} pairs: {row['old_us']:.1f} -> {row['new_us']:.1f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_mxfp4_prefill.json").write_text(json.dumps(result, indent=1))
    bad = [r for part in ("moe", "linear", "align") for r in result[part] if r["rel_err"] > 1e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
