"""MLA's absorbed per-head products at decode sizes: torch.bmm (what attend ran before) against the
GEMV kernel kernels_rocm.skinny_gemm.skinny_bmm, at Kimi-K2.5's dims (qk_nope P 128, v_head V 128,
kv_lora L 512) with one TP8 rank's 8 heads and TP1's 64, T = 1, 4, 8 tokens a launch.

  q_latent [T, N, L] = q_nope [T, N, P] . W_UK [N, P, L]   (bmm on W_UK's view; the kernel on W_UK^T)
  out      [T, N, V] = out_latent [T, N, L] . W_UV [N, V, L]^T

Operands as attend passes them: q_nope a strided view of q [T, N, P + R], W_UK / W_UV views of
kv_b_proj's weight, W_UK^T the copy MLAAttention.process_weights_after_loading makes. Times are
triton.testing.do_bench medians (L2 flushed before each call, as a 61-layer decode step finds it),
bmm including the transposed views' handling; also a few skinny_bmm configs around the default;
and bmm vs the default config replayed in a CUDA graph (do_bench_cudagraph, L2 warm), as decode runs them.
Every kernel result is checked against the fp32 product first (relative error < 4e-3).

  python ci/bench_absorb.py [--out results.json]      (one NVIDIA GPU, well under a minute)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_rocm._util import num_compute_units  # noqa: E402
from kernels_rocm.skinny_gemm import GemvConfig, default_bmm_config, skinny_bmm  # noqa: E402

P, R, V, L = 128, 64, 128, 512


def _name(c: GemvConfig) -> str:
    return f"{c.block_n}x{c.num_warps}w{c.vector_bytes}B"


def bench(heads: int, t: int, device: torch.device) -> list[dict]:
    from triton.testing import do_bench, do_bench_cudagraph

    g = torch.Generator(device=device).manual_seed(heads * 10 + t)
    kv_b = torch.randn(heads * (P + V), L, generator=g, device=device).mul_(0.05).bfloat16()
    w = kv_b.view(heads, P + V, L)
    w_uk, w_uv = w[:, :P], w[:, P:]
    w_uk_t = w_uk.transpose(1, 2).contiguous()
    q_nope = torch.randn(t, heads, P + R, generator=g, device=device).bfloat16()[..., :P]
    out_latent = torch.randn(t, heads, L, generator=g, device=device).bfloat16()
    products = {
        "W_UK": (lambda: torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_nope, w_uk_t),
        "W_UV": (lambda: torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1), out_latent, w_uv),
    }
    rows = []
    for name, (bmm, x, wk) in products.items():
        n, k = wk.shape[1], wk.shape[2]
        ref = torch.bmm(x.transpose(0, 1).float(), wk.float().transpose(1, 2)).transpose(0, 1)
        default = default_bmm_config(t, heads, n, k, 2, num_compute_units(device))
        configs = [default] + [GemvConfig(b, default.num_warps, default.vector_bytes) for b in (1, 2, 4, 8)
                               if b * (1 << (t - 1).bit_length()) <= 64]
        sweep = {}
        for config in dict.fromkeys(configs):
            out = skinny_bmm(x, wk, config).float()
            err = ((out - ref).norm() / ref.norm()).item()
            if err > 4e-3:
                raise AssertionError(f"skinny_bmm {name} heads {heads} T {t} {config}: relative error {err:.2e}")
            sweep[_name(config)] = 1e3 * do_bench(lambda: skinny_bmm(x, wk, config), warmup=10, rep=50)
        bmm_us = 1e3 * do_bench(bmm, warmup=10, rep=50)
        best = min(sweep, key=sweep.get)
        # back to back in one CUDA graph, as a decode step replays them (no L2 flush: ~1 MB stays cached)
        graph_us = {"bmm": 1e3 * do_bench_cudagraph(bmm, rep=50),
                    "default": 1e3 * do_bench_cudagraph(lambda: skinny_bmm(x, wk, default), rep=50)}
        rows.append(dict(product=name, heads=heads, t=t, weight_bytes=wk.numel() * 2, bmm_us=bmm_us,
                         default=_name(default), default_us=sweep[_name(default)], best=best, best_us=sweep[best],
                         graph_bmm_us=graph_us["bmm"], graph_default_us=graph_us["default"], sweep=sweep))
    return rows


def markdown(rows: list[dict], device_name: str) -> str:
    lines = [f"MLA absorbed products, bf16, {device_name} (triton do_bench medians, L2 flushed)", "",
             "| product | heads | T | weight KiB | bmm us | skinny_bmm default us (config) | best us (config) | speedup (default) "
             "| graph: bmm us | graph: default us |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['product']} | {r['heads']} | {r['t']} | {r['weight_bytes'] // 1024} | {r['bmm_us']:.2f} | "
                     f"{r['default_us']:.2f} ({r['default']}) | {r['best_us']:.2f} ({r['best']}) | "
                     f"{r['bmm_us'] / r['default_us']:.2f}x | {r['graph_bmm_us']:.2f} | {r['graph_default_us']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.version.hip is not None:
        sys.exit("bench_absorb: needs an NVIDIA GPU (the GEMV kernel is not used on ROCm)")
    device = torch.device("cuda")
    rows = [r for heads in (8, 64) for t in (1, 4, 8) for r in bench(heads, t, device)]
    print(markdown(rows, torch.cuda.get_device_name(device)))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
