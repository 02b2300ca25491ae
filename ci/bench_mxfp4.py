"""MXFP4 fused MoE / Linear and FP8-KV MLA decode on one GPU (issue 12 speed must-show).

Measures, all in one run so the ratios share a machine state:
- copy bandwidth: one 4 GiB device-to-device copy, bytes read + written (the roofline);
- fused MoE over MXFP4 experts (kernels_rocm.mxfp4_moe) at Kimi-K2.5's per-rank TP8 shape
  (E384, top-8, H7168, I256) and full width (I2048), T = 1..512 tokens, uniform random routing,
  with bf16 activations (W4A16) and with the fused MXFP4 activation QDQ (W4A4 emulated):
  GB/s = (packed weight bytes + E8M0 scale bytes of the experts routed to + x read + out
  written) / time, as a fraction of the copy bandwidth (goal >= 70% from T = 32), and the
  speedup over the bf16 fused MoE (kernels_rocm.fused_moe) at the same shape (goal >= 3x at
  T <= 32); every MXFP4 row is checked against the dequantize reference (relative error);
- MXFP4 dense Linear at the Kimi TP8 shared-expert / dense-MLP shapes;
- absorbed MLA decode (8 heads, 512 + 64) over an fp8 (e4m3fn) latent cache vs the bf16 cache
  at 8k and 32k context: GB/s over the KV bytes read (goal >= 80% of copy at 32k) and the KV
  capacity gained (bytes per token).
Timing: each call is captured once in a CUDA graph and each replay follows a 256 MB read, so the
50 MB L2 never holds the weights or KV of the previous repetition and holds only clean lines, as in
a decode step (ci/gpu_timing.FLUSH; `--flush zero` times with triton.testing.do_bench, whose memset
leaves dirty lines the call must write back). Medians.
`--profile` adds per-kernel times of one MoE call (torch.profiler); `--sweep` times alternative
tile configurations (MoE GEMMs; MLA launch options and the fp8 upcast before the PTX one) of
the parts run, to tune the defaults; `--parts mla --sweep` runs the MLA part alone, `--parts
moe-sweep` the MoE tile sweep alone (GEMM 2 programs walking several N tiles among its variants).

Usage: python ci/bench_mxfp4.py [--out DIR] [--quick] [--parts moe,linear,mla,moe-sweep] [--profile] [--sweep]
Writes bench_mxfp4.json and bench_mxfp4.md to DIR (default $OUT or ./bench_out) and prints a
short table last. Exit 1 if a correctness check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import gpu_timing  # noqa: E402
from gpu_timing import measure_copy_bandwidth, rel_error, time_graph  # noqa: E402
import kernels_rocm.mla_decode as mla_mod  # noqa: E402
from kernels_rocm.mla_decode import mla_paged_attention  # noqa: E402
from kernels_rocm._mxfp4 import foldable_scales  # noqa: E402
from kernels_rocm.fused_moe import fused_moe  # noqa: E402
from kernels_rocm.mxfp4_linear import GemmConfig, mxfp4_linear  # noqa: E402
from kernels_rocm.mxfp4_moe import MoeConfig, default_config, fused_moe_mxfp4  # noqa: E402
from model_ops.attention import torch_ref  # noqa: E402
from model_ops.attention.metadata import AttentionMetadata  # noqa: E402
from model_ops.quant.fp8 import dequantize_fp8, quantize_fp8  # noqa: E402
from model_ops.quant.mxfp4 import dequantize_mxfp4, qdq_mxfp4  # noqa: E402

DEVICE = "cuda"
MOE_SHAPES = {"Kimi TP8 E384 H7168 I256": (384, 8, 7168, 256), "Kimi full E384 H7168 I2048": (384, 8, 7168, 2048)}
MOE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MOE_CHECK_TOKENS = (1, 32, 512)
LINEAR_SHAPES = {"shared gate_up TP8 N512 K7168": (512, 7168), "dense down TP8 N7168 K2304": (7168, 2304)}
LINEAR_TOKENS = (1, 8, 32, 256)
MLA_BATCHES = (1, 8, 32, 64)
MLA_CONTEXTS = (8192, 32768)
KIMI_LAYERS = 61
REL_TOL = 1e-2
GOAL_MOE_FRACTION, GOAL_MOE_SPEEDUP, GOAL_MLA_FRACTION = 0.70, 3.0, 0.80


def random_mxfp4(*shape, g):
    """Random packed codes, E8M0 bytes 116..123 (weights of magnitude 2^-11 .. 2^-2)."""
    packed = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=g, device=DEVICE, dtype=torch.uint8)
    scale = torch.randint(116, 124, (*shape[:-1], shape[-1] // 32), generator=g, device=DEVICE, dtype=torch.uint8)
    return packed, scale


def moe_reference(x, w13, s13, w2, s2, topk_weights, topk_ids, quantize):
    inter = w13.shape[1] // 2
    a = qdq_mxfp4(x) if quantize else x
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = a[token].float() @ dequantize_mxfp4(w13[e], s13[e]).T
        h = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        if quantize:
            h = qdq_mxfp4(h)
        out.index_add_(0, token, (h.float() @ dequantize_mxfp4(w2[e], s2[e]).T) * topk_weights[token, slot, None])
    return out


def routing(num_tokens: int, num_experts: int, top_k: int, g: torch.Generator):
    scores = torch.rand(num_tokens, num_experts, generator=g, device=DEVICE)
    weights, ids = scores.topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32).contiguous()


@dataclass
class MoeRow:
    shape: str
    tokens: int
    experts_hit: int
    mb_touched: float  # MXFP4 bytes counted for GB/s, MB
    w4a16_us: float
    w4a16_gbps: float
    w4a16_fraction: float
    w4a4_us: float
    w4a4_gbps: float
    w4a4_fraction: float
    bf16_us: float
    bf16_gbps: float
    speedup_w4a16: float
    speedup_w4a4: float
    rel_err_w4a16: float | None
    rel_err_w4a4: float | None


class MoeWeights:
    def __init__(self, shape: tuple[int, int, int, int], with_bf16: bool, seed: int = 0):
        self.num_experts, self.top_k, self.hidden, self.inter = shape
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        e, h, i = self.num_experts, self.hidden, self.inter
        self.w13, self.s13 = random_mxfp4(e, 2 * i, h, g=g)
        self.w2, self.s2 = random_mxfp4(e, h, i, g=g)
        self.fold = foldable_scales(self.s13, self.s2)  # as the engine's MXFP4Experts decides after loading
        self.bf16 = None
        if with_bf16:  # the baseline: same shapes in bf16 (values need not match the MXFP4 ones)
            self.bf16 = (torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=DEVICE).normal_(std=h**-0.5),
                         torch.empty(e, h, i, dtype=torch.bfloat16, device=DEVICE).normal_(std=i**-0.5))

    def expert_bytes(self) -> int:
        return self.w13[0].numel() + self.s13[0].numel() + self.w2[0].numel() + self.s2[0].numel()

    def run(self, x, weights, ids, quantize, config=None, out=None):
        return fused_moe_mxfp4(x, self.w13, self.s13, self.w2, self.s2, weights, ids, quantize, out=out, config=config,
                               fold_scales=self.fold)



def moe_call_inputs(weights: "MoeWeights", tokens: int, gen: torch.Generator):
    """x, routing weights and ids, an output buffer, the experts hit and the bytes a call reads
    (packed weights and scales of the experts hit, x read and out written)."""
    x = torch.randn(tokens, weights.hidden, generator=gen, device=DEVICE).bfloat16()
    topk_weights, ids = routing(tokens, weights.num_experts, weights.top_k, gen)
    hit = int(torch.unique(ids).numel())
    return x, topk_weights, ids, torch.empty_like(x), hit, hit * weights.expert_bytes() + 2 * x.numel() * x.element_size()


def bench_moe(copy_gbps: float, shapes: dict, token_counts, check_tokens) -> list[MoeRow]:
    rows = []
    for name, shape in shapes.items():
        weights_ = MoeWeights(shape, with_bf16=True)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        for tokens in token_counts:
            x, topk_weights, ids, out, hit, num_bytes = moe_call_inputs(weights_, tokens, gen)
            times, errors = {}, {}
            for quantize in (False, True):
                times[quantize] = time_graph(lambda: weights_.run(x, topk_weights, ids, quantize, out=out))
                errors[quantize] = None
                if tokens in check_tokens:
                    ref = moe_reference(x, weights_.w13, weights_.s13, weights_.w2, weights_.s2, topk_weights, ids, quantize)
                    errors[quantize] = rel_error(weights_.run(x, topk_weights, ids, quantize), ref)
            w13_bf16, w2_bf16 = weights_.bf16
            bf16_ms = time_graph(lambda: fused_moe(x, w13_bf16, w2_bf16, topk_weights, ids, out=out))
            bf16_bytes = hit * 3 * weights_.inter * weights_.hidden * 2 + 2 * x.numel() * 2
            gbps = {q: num_bytes / times[q] / 1e6 for q in times}
            rows.append(MoeRow(
                name, tokens, hit, num_bytes / 1e6,
                times[False] * 1e3, gbps[False], gbps[False] / copy_gbps,
                times[True] * 1e3, gbps[True], gbps[True] / copy_gbps,
                bf16_ms * 1e3, bf16_bytes / bf16_ms / 1e6,
                bf16_ms / times[False], bf16_ms / times[True], errors[False], errors[True],
            ))
            print(f"  {name} T={tokens}: w4a16 {times[False] * 1e3:.1f} us ({gbps[False]:.0f} GB/s), "
                  f"w4a4 {times[True] * 1e3:.1f} us, bf16 {bf16_ms * 1e3:.1f} us", flush=True)
        del weights_
        torch.cuda.empty_cache()
    return rows


def profile_moe(shape: tuple, tokens_list=(1, 32, 512)) -> list[dict]:
    """Per-kernel GPU time of one fused_moe_mxfp4 call (w4a4), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    weights_ = MoeWeights(shape, with_bf16=False)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    result = []
    for tokens in tokens_list:
        x = torch.randn(tokens, weights_.hidden, generator=gen, device=DEVICE).bfloat16()
        topk_weights, ids = routing(tokens, weights_.num_experts, weights_.top_k, gen)
        for _ in range(3):
            weights_.run(x, topk_weights, ids, True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                weights_.run(x, topk_weights, ids, True)
            torch.cuda.synchronize()
        for evt in prof.key_averages():
            if evt.device_type.name == "CUDA" and evt.count:
                result.append({"tokens": tokens, "kernel": evt.key[:60], "us": evt.device_time_total / evt.count,
                               "calls_per_moe": evt.count / 10})
    del weights_
    torch.cuda.empty_cache()
    return result


def sweep_moe(shapes: dict) -> list[dict]:
    """Whole-call W4A4 time for alternative tiles of one GEMM (the other at its default). GEMM 1
    variants at the points of the original sweep; GEMM 2 variants, with programs walking several
    N tiles (MoeConfig.down_n_tiles) among them, also at T = 256 / 512, the grouped path's range.
    Each variant's output is checked against the default config's (rel err <= REL_TOL)."""
    gate_up_variants = [
        dict(block_n=64, block_k=128), dict(block_n=32, block_k=128), dict(block_n=64, block_k=64),
        dict(block_n=128, block_k=64), dict(block_n=128, block_k=64, num_warps=8),
    ]
    # (GEMM 2 tile fields, N tiles a program walks); the walks only in the grouped path's range
    down_variants = [(dict(block_n=128, block_k=128), 1), (dict(block_n=64, block_k=64), 1),
                     (dict(block_n=32, block_k=128), 1)]
    down_walks = [(dict(block_n=64, block_k=128), n) for n in (2, 4, 8, 16, 28)]
    down_walks += [(dict(block_n=64, block_k=256), 8), (dict(block_n=128, block_k=128), 4),
                   (dict(block_n=32, block_k=128), 16)]
    gate_up_points = {"Kimi TP8 E384 H7168 I256": (1, 32, 512), "Kimi full E384 H7168 I2048": (32,)}
    points = {"Kimi TP8 E384 H7168 I256": (1, 32, 256, 512), "Kimi full E384 H7168 I2048": (32, 256, 512)}
    rows = []
    for name, shape in shapes.items():
        if name not in points:
            continue
        weights_ = MoeWeights(shape, with_bf16=False)
        gen = torch.Generator(device=DEVICE).manual_seed(3)
        for tokens in points[name]:
            x = torch.randn(tokens, weights_.hidden, generator=gen, device=DEVICE).bfloat16()
            topk_weights, ids = routing(tokens, weights_.num_experts, weights_.top_k, gen)
            out = torch.empty_like(x)
            base = default_config(tokens, weights_.top_k, weights_.num_experts, weights_.hidden, weights_.inter,
                                  torch.device(DEVICE))
            splits = sorted({1, 2, 4, 8, 16, base.gate_up.split_k})
            configs = [("default", base)]
            for v in gate_up_variants if tokens in gate_up_points[name] else ():
                for split in splits if v == gate_up_variants[0] and tokens == 1 else (base.gate_up.split_k,):
                    cfg = GemmConfig(base.gate_up.block_m, split_k=split, **{"num_warps": 4, "num_stages": 3, **v})
                    configs.append((f"gate_up {cfg}", MoeConfig(cfg, base.down)))
            for v, n_tiles in down_variants + (down_walks if tokens >= 256 else []):
                cfg = GemmConfig(base.down.block_m, **{"num_warps": 4, "num_stages": 3, **v})
                configs.append((f"down {cfg} n_tiles={n_tiles}", MoeConfig(base.gate_up, cfg, down_n_tiles=n_tiles)))
            expected = weights_.run(x, topk_weights, ids, True, config=base)
            for label, cfg in configs:
                try:
                    us = time_graph(lambda: weights_.run(x, topk_weights, ids, True, config=cfg, out=out)) * 1e3
                    err = rel_error(weights_.run(x, topk_weights, ids, True, config=cfg), expected)
                except Exception as exc:  # a config the compiler rejects (resources): report, go on
                    us, err, label = float("nan"), None, f"{label} FAILED {type(exc).__name__}"
                rows.append({"shape": name, "tokens": tokens, "config": label, "us": us, "rel_err_vs_default": err})
            mine = [r for r in rows if r["shape"] == name and r["tokens"] == tokens]
            best = min(mine, key=lambda r: r["us"])
            print(f"  sweep {name} T={tokens}: default {mine[0]['us']:.1f} us, best {best['us']:.1f} us "
                  f"({best['config']})", flush=True)
        del weights_
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------- Linear

@dataclass
class LinearRow:
    shape: str
    tokens: int
    quantize: bool
    us: float
    gbps: float
    fraction_of_copy: float
    rel_err: float


def bench_linear(copy_gbps: float, token_counts=LINEAR_TOKENS) -> list[LinearRow]:
    rows = []
    g = torch.Generator(device=DEVICE).manual_seed(4)
    for name, (n, k) in LINEAR_SHAPES.items():
        packed, scale = random_mxfp4(n, k, g=g)
        fold = foldable_scales(scale)  # as the engine's MXFP4Linear decides after loading
        dense = dequantize_mxfp4(packed, scale)
        for tokens in token_counts:
            x = torch.randn(tokens, k, generator=g, device=DEVICE).bfloat16()
            out = torch.empty(tokens, n, dtype=torch.bfloat16, device=DEVICE)
            for quantize in (False, True):
                ms = time_graph(lambda: mxfp4_linear(x, packed, scale, None, quantize, out=out, fold_scales=fold))
                num_bytes = packed.numel() + scale.numel() + 2 * (x.numel() + out.numel())
                a = qdq_mxfp4(x) if quantize else x
                err = rel_error(mxfp4_linear(x, packed, scale, None, quantize, fold_scales=fold), a.float() @ dense.T)
                gbps = num_bytes / ms / 1e6
                rows.append(LinearRow(name, tokens, quantize, ms * 1e3, gbps, gbps / copy_gbps, err))
    return rows


# ---------------------------------------------------------------------------------------- MLA

@dataclass
class MlaRow:
    kv: str
    batch: int
    context: int
    us: float
    gbps: float
    fraction_of_copy: float
    speedup_vs_bf16: float | None
    rel_err: float | None


def _decode_metadata(batch: int, context: int, num_blocks: int, gen: torch.Generator, block_size: int = 16):
    blocks = context // block_size
    tables = torch.randperm(num_blocks, generator=gen, device=DEVICE)[: batch * blocks].view(batch, blocks)
    return AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEVICE),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(torch.int32),
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=DEVICE),
        max_query_len=1, max_context_len=context,
    )


def bench_mla(copy_gbps: float, batches=MLA_BATCHES, contexts=MLA_CONTEXTS, heads: int = 8,
              latent: int = 512, rope: int = 64, kinds=("bf16", "fp8 e4m3fn")) -> list[MlaRow]:
    block_size = 16
    num_blocks = max(batches) * max(contexts) // block_size + 1
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    scale = torch.tensor([0.05], device=DEVICE)
    bf16_cache = torch.empty(num_blocks, block_size, latent + rope, dtype=torch.bfloat16, device=DEVICE).normal_()
    fp8_cache = quantize_fp8(bf16_cache, scale, torch.float8_e4m3fn)
    caches = {"bf16": (bf16_cache, None), "fp8 e4m3fn": (fp8_cache, scale)}
    rows = []
    for context in contexts:
        for batch in batches:
            meta = _decode_metadata(batch, context, num_blocks, gen, block_size)
            q = torch.randn(batch, heads, latent + rope, generator=gen, device=DEVICE).bfloat16()
            out = torch.empty(batch, heads, latent, dtype=torch.bfloat16, device=DEVICE)
            times = {}
            for kind in kinds:
                cache, kv_scale = caches[kind]
                def run(cache=cache, kv_scale=kv_scale):
                    return mla_paged_attention(q[..., :latent], q[..., latent:], cache, *_meta_args(meta), 192**-0.5,
                                               kv_scale=kv_scale, out=out)
                times[kind] = time_graph(run)
                err = None
                if batch * context <= 8 * 32768:
                    used = meta.block_tables.unique().long()
                    dense = dequantize_fp8(cache[used], kv_scale) if kv_scale is not None else cache[used].float()
                    remap = torch.full((num_blocks,), -1, dtype=torch.int32, device=DEVICE)
                    remap[used] = torch.arange(used.numel(), dtype=torch.int32, device=DEVICE)
                    local = AttentionMetadata(meta.query_start_loc, meta.context_lens, remap[meta.block_tables.long()],
                                              meta.slot_mapping, 1, context)
                    ref = torch_ref.paged_attention(q.float(), dense.unsqueeze(2), dense[..., :latent].unsqueeze(2),
                                                    local, 192**-0.5)
                    err = rel_error(run(), ref)
                    del dense
                elem = 1 if kv_scale is not None else 2
                gbps = batch * (context * (latent + rope) * elem + heads * (2 * latent + rope) * 2) / times[kind] / 1e6
                speedup = times["bf16"] / times[kind] if kind != "bf16" and "bf16" in times else None
                rows.append(MlaRow(kind, batch, context, times[kind] * 1e3, gbps, gbps / copy_gbps, speedup, err))
    del bf16_cache, fp8_cache, caches
    torch.cuda.empty_cache()
    return rows


def _meta_args(meta):
    return (meta.query_start_loc, meta.context_lens, meta.block_tables, meta.max_query_len, meta.max_context_len)


MLA_SWEEP = [  # (fp8 upcast, (KV tokens per tile, warps, stages)); the first two are the defaults
    ("ptx", (32, 4, 3)), ("triton", (32, 8, 2)),
    ("ptx", (32, 4, 2)), ("ptx", (64, 8, 2)), ("ptx", (64, 8, 3)), ("ptx", (32, 8, 2)), ("ptx", (16, 4, 2)),
]


def sweep_mla(copy_gbps: float) -> list[dict]:
    """fp8 MLA decode at 32k, batch 8 and 64: launch options (tile, warps, stages) of the PTX
    upcast path, and Triton's own upcast in the dot layout (the path before it) for comparison."""
    original_options, original_ptx = mla_mod.launch_options, mla_mod.upcasts_with_ptx
    rows = []
    try:
        for upcast, option in MLA_SWEEP:
            label = f"{upcast} {option}"
            mla_mod.launch_options = lambda kv_dtype, option=option: option
            mla_mod.upcasts_with_ptx = (lambda kv_dtype: False) if upcast == "triton" else original_ptx
            try:
                for r in bench_mla(copy_gbps, batches=(8, 64), contexts=(32768,), kinds=("fp8 e4m3fn",)):
                    rows.append({"option": label, "batch": r.batch, "us": r.us, "fraction": r.fraction_of_copy,
                                 "rel_err": r.rel_err})
            except Exception as exc:  # a variant the compiler rejects (resources): report, go on
                rows.append({"option": label, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            print(f"  sweep MLA fp8 {label}: {[round(r.get('fraction', 0), 3) for r in rows if r['option'] == label]}",
                  flush=True)
    finally:
        mla_mod.launch_options, mla_mod.upcasts_with_ptx = original_options, original_ptx
    return rows


# ------------------------------------------------------------------------------------ report

def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def kv_capacity() -> dict:
    bf16, fp8 = KIMI_LAYERS * 576 * 2, KIMI_LAYERS * 576
    pool = 40 * 2**30
    return {"bytes_per_token_bf16": bf16, "bytes_per_token_fp8": fp8, "tokens_per_40GiB_bf16": pool // bf16,
            "tokens_per_40GiB_fp8": pool // fp8, "gain": bf16 / fp8}


def to_markdown(results: dict) -> str:
    copy = results["copy"]
    lines = [f"# MXFP4 / FP8-KV kernels: {results['device']}", "",
             f"torch {results['torch']}, triton {results['triton']}, {results['date']}. Copy bandwidth (read + write): "
             f"**{copy['gbps']:.0f} GB/s**. CUDA-graph replays, L2 flushed between repetitions "
             f"({results.get('flush', 'zero')}: see --flush), medians.", ""]
    if results.get("moe"):
        lines += ["## Fused MoE over MXFP4 experts (GB/s: packed weights + scales of the experts hit + x + out)", "",
                  "| shape | T | experts hit | MB | W4A16 µs | GB/s | % copy | W4A4-QDQ µs | GB/s | % copy | bf16 µs | "
                  "bf16 GB/s | speedup W4A16 | speedup W4A4 | rel err W4A16 / W4A4 |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in results["moe"]:
            lines.append(
                f"| {r['shape']} | {r['tokens']} | {r['experts_hit']} | {r['mb_touched']:.0f} | {r['w4a16_us']:.1f} | "
                f"{r['w4a16_gbps']:.0f} | {r['w4a16_fraction'] * 100:.0f}% | {r['w4a4_us']:.1f} | {r['w4a4_gbps']:.0f} | "
                f"{r['w4a4_fraction'] * 100:.0f}% | {r['bf16_us']:.1f} | {r['bf16_gbps']:.0f} | {r['speedup_w4a16']:.1f}x | "
                f"{r['speedup_w4a4']:.1f}x | {_fmt(r['rel_err_w4a16'], '.1e')} / {_fmt(r['rel_err_w4a4'], '.1e')} |")
    if results.get("linear"):
        lines += ["", "## MXFP4 dense Linear", "", "| shape | M | act QDQ | µs | GB/s | % copy | rel err |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for r in results["linear"]:
            lines.append(f"| {r['shape']} | {r['tokens']} | {'yes' if r['quantize'] else 'no'} | {r['us']:.1f} | "
                         f"{r['gbps']:.0f} | {r['fraction_of_copy'] * 100:.0f}% | {r['rel_err']:.1e} |")
    if results.get("mla"):
        cap = results["kv_capacity"]
        lines += ["", "## MLA decode (8 heads, 512 + 64, block 16): bf16 vs fp8 latent cache", "",
                  f"KV per token (61 layers): bf16 {cap['bytes_per_token_bf16']:,} B, fp8 {cap['bytes_per_token_fp8']:,} B: "
                  f"a 40 GiB pool holds {cap['tokens_per_40GiB_bf16']:,} vs {cap['tokens_per_40GiB_fp8']:,} tokens "
                  f"({cap['gain']:.1f}x).", "",
                  "| KV | batch | context | µs | GB/s | % copy | speedup vs bf16 | rel err |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in results["mla"]:
            lines.append(f"| {r['kv']} | {r['batch']} | {r['context']} | {r['us']:.1f} | {r['gbps']:.0f} | "
                         f"{r['fraction_of_copy'] * 100:.0f}% | {_fmt(r['speedup_vs_bf16'], '.2f')} | {_fmt(r['rel_err'], '.1e')} |")
    if results.get("profile"):
        lines += ["", "## Kernel breakdown of one MoE call (W4A4, Kimi TP8)", "", "| T | kernel | µs | calls |",
                  "|---:|---|---:|---:|"]
        for r in results["profile"]:
            lines.append(f"| {r['tokens']} | {r['kernel']} | {r['us']:.1f} | {r['calls_per_moe']:.0f} |")
    if results.get("sweep_moe"):
        lines += ["", "## Sweep: MoE tiles (W4A4 whole-call µs)", "",
                  "| shape | T | config | µs | vs default | rel err vs default |", "|---|---:|---|---:|---:|---|"]
        default_us = {(r["shape"], r["tokens"]): r["us"] for r in results["sweep_moe"] if r["config"] == "default"}
        for r in results["sweep_moe"]:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['config']} | {r['us']:.1f} | "
                         f"{r['us'] / default_us[r['shape'], r['tokens']]:.3f} | {_fmt(r.get('rel_err_vs_default'), '.1e')} |")
    if results.get("sweep_mla"):
        lines += ["", "## Sweep: fp8 MLA upcast and launch options (tile, warps, stages) at 32k", "",
                  "| upcast, option | batch | µs | % copy | rel err |", "|---|---:|---:|---:|---:|"]
        for r in results["sweep_mla"]:
            if "error" in r:
                lines.append(f"| {r['option']} | - | {r['error']} | - | - |")
            else:
                lines.append(f"| {r['option']} | {r['batch']} | {r['us']:.1f} | {r['fraction'] * 100:.0f}% | "
                             f"{_fmt(r['rel_err'], '.1e')} |")
    lines += ["", "## Summary", ""] + [f"- {s}" for s in results["summary"]]
    return "\n".join(lines) + "\n"


def summarize(results: dict) -> tuple[list[str], list[str]]:
    failures, summary = [], []
    for r in results.get("moe", []):
        for key in ("rel_err_w4a16", "rel_err_w4a4"):
            if r[key] is not None and not r[key] <= REL_TOL:
                failures.append(f"MoE {r['shape']} T={r['tokens']} {key} {r[key]:.2e} > {REL_TOL}")
    for r in results.get("linear", []):
        if not r["rel_err"] <= REL_TOL:
            failures.append(f"Linear {r['shape']} M={r['tokens']} rel err {r['rel_err']:.2e}")
    for r in results.get("mla", []):
        if r["rel_err"] is not None and not r["rel_err"] <= REL_TOL:
            failures.append(f"MLA {r['kv']} batch {r['batch']} ctx {r['context']} rel err {r['rel_err']:.2e}")
    for r in results.get("sweep_moe", []):
        if r.get("rel_err_vs_default") is not None and not r["rel_err_vs_default"] <= REL_TOL:
            failures.append(f"MoE sweep {r['shape']} T={r['tokens']} {r['config']} rel err vs default "
                            f"{r['rel_err_vs_default']:.2e}")
    for r in results.get("sweep_mla", []):
        if r.get("rel_err") is not None and not r["rel_err"] <= REL_TOL:
            failures.append(f"MLA sweep {r['option']} batch {r['batch']} rel err {r['rel_err']:.2e}")
    for shape in dict.fromkeys(r["shape"] for r in results.get("moe", [])):
        moe = [r for r in results["moe"] if r["shape"] == shape]
        bw = [r for r in moe if r["tokens"] >= 32]
        small = [r for r in moe if r["tokens"] <= 32]
        # the goals are judged on W4A4, the released checkpoint's activations (W4A16 is the
        # --mxfp4-activations unquantized comparison mode, reported beside it)
        if bw:
            worst = min(bw, key=lambda r: r["w4a4_fraction"])
            summary.append(f"{shape}: W4A4 from T=32 at >= {worst['w4a4_fraction'] * 100:.0f}% of copy (T={worst['tokens']}) "
                           f"— {'meets' if worst['w4a4_fraction'] >= GOAL_MOE_FRACTION else 'misses'} the 70% goal; W4A16 "
                           f">= {min(r['w4a16_fraction'] for r in bw) * 100:.0f}%")
        if small:
            worst = min(small, key=lambda r: r["speedup_w4a4"])
            summary.append(f"{shape}: speedup over bf16 at T <= 32 >= {worst['speedup_w4a4']:.1f}x W4A4 "
                           f"(T={worst['tokens']}) — {'meets' if worst['speedup_w4a4'] >= GOAL_MOE_SPEEDUP else 'misses'} "
                           f"the 3x goal; W4A16 >= {min(r['speedup_w4a16'] for r in small):.1f}x")
    fp8_long = [r for r in results.get("mla", []) if r["kv"] != "bf16" and r["context"] == max(MLA_CONTEXTS)]
    if fp8_long:
        best = max(fp8_long, key=lambda r: r["fraction_of_copy"])
        summary.append(f"fp8 MLA decode at {best['context']}: best {best['fraction_of_copy'] * 100:.0f}% of copy "
                       f"(batch {best['batch']}), {best['speedup_vs_bf16']:.2f}x the bf16 cache — "
                       f"{'meets' if best['fraction_of_copy'] >= GOAL_MLA_FRACTION else 'misses'} the 80% goal")
    summary.append("correctness: all checks passed" if not failures else f"correctness: {len(failures)} FAILED")
    return summary + failures, failures


def short_table(results: dict) -> str:
    lines = [f"copy {results['copy']['gbps']:.0f} GB/s"]
    for r in results.get("moe", []):
        lines.append(f"{r['shape'][:14]:14s} T={r['tokens']:4d} W4A16 {r['w4a16_us']:8.1f}us {r['w4a16_fraction'] * 100:4.0f}% "
                     f"W4A4 {r['w4a4_us']:8.1f}us {r['w4a4_fraction'] * 100:4.0f}% bf16 {r['bf16_us']:8.1f}us "
                     f"x{r['speedup_w4a16']:.1f}/x{r['speedup_w4a4']:.1f}")
    for r in results.get("mla", []):
        lines.append(f"MLA {r['kv']:10s} b={r['batch']:3d} ctx={r['context']:6d} {r['us']:8.1f}us {r['fraction_of_copy'] * 100:4.0f}%")
    return "\n".join(lines + results["summary"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    parser.add_argument("--quick", action="store_true", help="a few configurations only (smoke run)")
    parser.add_argument("--parts", default="moe,linear,mla",
                        help="comma list of moe, linear, mla, moe-sweep (the MoE tile sweep alone)")
    parser.add_argument("--profile", action="store_true", help="per-kernel times of one MoE call")
    parser.add_argument("--sweep", action="store_true", help="time alternative tiles / launch options")
    parser.add_argument("--flush", choices=("zero", "read"), default="read",
                        help="L2 between repetitions: read (clean lines, as in a decode step) or zeroed as do_bench does (dirty)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_mxfp4: no CUDA/ROCm GPU available", file=sys.stderr)
        return 2
    gpu_timing.FLUSH = args.flush
    parts = set(args.parts.split(","))
    start = time.time()
    copy = measure_copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "date": time.strftime("%Y-%m-%d"), "copy": copy, "kv_capacity": kv_capacity(), "flush": args.flush}
    print(f"copy {copy['gbps']:.0f} GB/s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)

    def save():  # after every part, so a run cut short still leaves what it measured
        results["summary"], results["failures"] = summarize(results)
        results["seconds"] = time.time() - start
        (args.out / "bench_mxfp4.json").write_text(json.dumps(results, indent=2))
        (args.out / "bench_mxfp4.md").write_text(to_markdown(results))

    tokens = (1, 32, 512) if args.quick else MOE_TOKENS
    if "moe" in parts:
        results["moe"] = [asdict(r) for r in bench_moe(copy["gbps"], MOE_SHAPES, tokens, MOE_CHECK_TOKENS)]
        save()
    if "mla" in parts:
        results["mla"] = [asdict(r) for r in bench_mla(copy["gbps"], (8, 64) if args.quick else MLA_BATCHES)]
        save()
    if "linear" in parts:
        results["linear"] = [asdict(r) for r in bench_linear(copy["gbps"], (1, 32) if args.quick else LINEAR_TOKENS)]
        save()
    if args.profile:
        results["profile"] = profile_moe(MOE_SHAPES["Kimi TP8 E384 H7168 I256"])
        save()
    if (args.sweep and "moe" in parts) or "moe-sweep" in parts:
        results["sweep_moe"] = sweep_moe(MOE_SHAPES)
        save()
    if args.sweep and "mla" in parts:
        results["sweep_mla"] = sweep_mla(copy["gbps"])
        save()
    save()
    print(to_markdown(results))
    print(short_table(results))
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
