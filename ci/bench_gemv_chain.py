"""The GEMV kernel in a chain of decode-layer kernels: this tree's kernels_rocm/skinny_gemm.py
against a baseline version of it, same run, PDL on and off.

A kernel timed alone (ci/bench_roofline.py part `gemm`) pays its whole launch and first DRAM
latency; in a decode step it follows another kernel, and with programmatic dependent launch
(kernels_rocm/_pdl.py) what it does before its wait overlaps that kernel's tail. This replays, in
one CUDA graph, the dense kernels of 61 (Kimi) or 32 (Llama) decode layers with distinct weights
(no L2 reuse) in the order a layer runs them:

- kimi (a Kimi-K2.5 TP8 rank, M = 1 and 4): RMSNorm -> fused q_a/kv_a 2112x7168 -> q_b 1536x1536
  with the q_a norm prologue -> W_UK^T 8 heads x 512x128 -> W_UV 8 heads x 128x512 -> o_proj
  7168x1024 -> RMSNorm -> router 384x7168 with fp32 logits
- llama8b (M = 1): RMSNorm -> qkv 6144x4096 -> o_proj 4096x4096 -> RMSNorm -> gate_up + SwiGLU
  28672x4096 -> down 4096x14336

Reports µs a layer (median of --reps replays / layers) and the chain's weight bytes over that time
against the copy bandwidth measured in the same run. Attention, routing and the MoE are left out:
this isolates what the GEMVs' launches cost between each other and the norms.

Usage: git show main:kernels_rocm/skinny_gemm.py > /tmp/skinny_gemm_main.py
       python ci/bench_gemv_chain.py --baseline /tmp/skinny_gemm_main.py [--out DIR]
Writes bench_gemv_chain.json to DIR (default $OUT or ./bench_out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "ci"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

from kernels_rocm import _pdl as pdl  # noqa: E402
from kernels_rocm import skinny_gemm as current  # noqa: E402
from kernels_rocm.rms_norm import rms_norm  # noqa: E402

from gpu_timing import ab_header, load_kernel_version  # noqa: E402


def _w(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02


def kimi_layer():
    w = dict(norm1=torch.ones(7168, device="cuda", dtype=torch.bfloat16), qakva=_w(2112, 7168),
             qa_norm=torch.ones(1536, device="cuda", dtype=torch.bfloat16), qb=_w(1536, 1536), uk=_w(8, 512, 128),
             uv=_w(8, 128, 512), o=_w(7168, 1024), norm2=torch.ones(7168, device="cuda", dtype=torch.bfloat16),
             router=_w(384, 7168))

    def run(mod, x):
        h = rms_norm(x, w["norm1"], 1e-6)
        latent = mod.skinny_gemm(h, w["qakva"])
        q = mod.skinny_gemm(latent[:, :1536], w["qb"], norm_weight=w["qa_norm"])  # [M, 8 x 192]
        q_nope = q.view(-1, 8, 192)[:, :, :128]
        q_latent = mod.skinny_bmm(q_nope, w["uk"])  # [M, 8, 512]
        out = mod.skinny_bmm(q_latent, w["uv"])  # [M, 8, 128], a stand-in for attention's latent output
        y = mod.skinny_gemm(out.reshape(-1, 1024), w["o"])
        h2 = rms_norm(y, w["norm2"], 1e-6)
        return y, mod.skinny_gemm(h2, w["router"], out_dtype=torch.float32)

    nbytes = sum(t.numel() * t.element_size() for k, t in w.items() if "norm" not in k)
    return run, nbytes


def llama_layer():
    w = dict(norm1=torch.ones(4096, device="cuda", dtype=torch.bfloat16), qkv=_w(6144, 4096), o=_w(4096, 4096),
             norm2=torch.ones(4096, device="cuda", dtype=torch.bfloat16), gate_up=_w(28672, 4096), down=_w(4096, 14336))

    def run(mod, x):
        h = rms_norm(x, w["norm1"], 1e-6)
        qkv = mod.skinny_gemm(h, w["qkv"])
        y = mod.skinny_gemm(qkv[:, :4096], w["o"])
        h2 = rms_norm(y, w["norm2"], 1e-6)
        act = mod.skinny_gemm(h2, w["gate_up"], swiglu=True)
        return mod.skinny_gemm(act, w["down"]), None

    nbytes = sum(t.numel() * t.element_size() for k, t in w.items() if "norm" not in k)
    return run, nbytes


CHAINS = {"kimi": (kimi_layer, 7168, (1, 4), 61), "llama8b": (llama_layer, 4096, (1,), 32)}  # (layer, hidden, Ms, layers)


def time_chain(layers, mod, m: int, hidden: int, reps: int) -> float:
    """Median µs of one replay of the graph of every layer's kernels."""
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)

    def chain():
        h = x
        for run, _ in layers:
            h, _ = run(mod, h)
        return h

    chain()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times[2:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a version of kernels_rocm/skinny_gemm.py")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--chains", default="kimi,llama8b")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gemv_chain: no CUDA GPU available", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    result = {**ab_header(args.baseline), "rows": []}
    copy = result["copy"]
    baseline = load_kernel_version(args.baseline, "skinny_gemm_baseline")
    for name in args.chains.split(","):
        make, hidden, ms, num_layers = CHAINS[name]
        layers = [make() for _ in range(num_layers)]
        nbytes = layers[0][1]
        for m in ms:
            # alternate the order so that neither version always runs on a warmer GPU
            for pdl_on in (True, False):
                pdl.set_enabled(pdl_on)
                us = {}
                for label, mod in (("new", current), ("old", baseline), ("new_again", current)):
                    us[label] = time_chain(layers, mod, m, hidden, args.reps) / num_layers
                row = dict(chain=name, m=m, pdl=pdl_on, layers=num_layers, layer_bytes=nbytes, **{f"us_{k}": v for k, v in us.items()},
                           **{f"copy_fraction_{k}": nbytes / (v * 1e-6) / (copy["gbps"] * 1e9) for k, v in us.items()})
                result["rows"].append(row)
                print(f"{name:8s} M={m} pdl={'on ' if pdl_on else 'off'} µs a layer: new {us['new']:.2f} old "
                      f"{us['old']:.2f} new again {us['new_again']:.2f}  old/new {us['old'] / us['new']:.3f}  "
                      f"new at {row['copy_fraction_new'] * 100:.0f}% of copy", flush=True)
                (args.out / "bench_gemv_chain.json").write_text(json.dumps(result, indent=2))
        del layers
        torch.cuda.empty_cache()
    pdl.set_enabled(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
