"""Kernel benchmarks on one GPU (CUDA or ROCm), in one run of about 1-2 minutes on an H100.

Measures
- copy bandwidth: one large device-to-device copy, bytes read + written (the practical roofline);
- decode attention, MHA (Kimi EAGLE3 draft per TP8 rank: 8 q / 8 kv heads, D 128) and absorbed
  MLA (Kimi per TP8 rank: 8 heads, L 512 + R 64), batch 1/8/32/64 x context 1k/8k/32k, block 16:
  achieved GB/s = (KV bytes actually read + q + out) / time, as a fraction of the copy bandwidth
  (goal >= 80% at long context), and the speedup over the PyTorch reference (skipped where its
  padded working set exceeds REF_MAX_BYTES);
- fused MoE (bf16) vs the per-expert PyTorch loop, E=64/top-8/H=2048/I=1024 and a Kimi TP8 shard
  (E=384, top-8, H=7168, I=256), T = 1..512: GB/s over the weights of the experts actually hit;
- fused residual-add + RMSNorm at H=7168 vs the eager HF-style version.
Every timed kernel output is also checked against its reference (relative error); a failed check
makes the run exit 1. Times are medians of triton.testing.do_bench (L2 flushed between reps).

Usage: python ci/bench_kernels.py [--out DIR] [--quick]; DIR defaults to $OUT or ./bench_out.
Writes bench_kernels.json and bench_kernels.md there and prints the markdown. Importable:
`run_all(out_dir, quick)` or the individual `bench_*` functions (the copy bandwidth: ci/gpu_timing.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from gpu_timing import measure_copy_bandwidth, rel_error  # noqa: E402
from kernels_rocm.fused_moe import fused_moe, moe_reference  # noqa: E402
from kernels_rocm.mla_decode import mla_paged_attention  # noqa: E402
from kernels_rocm._attention_common import MAX_KV_SPLITS  # noqa: E402
from kernels_rocm.paged_attention import paged_attention  # noqa: E402
from kernels_rocm.rms_norm import fused_add_rms_norm, rms_norm_reference  # noqa: E402
from model_ops.attention import torch_ref  # noqa: E402
from model_ops.attention.metadata import AttentionMetadata  # noqa: E402

WARMUP_MS, REP_MS = 10, 40
BLOCK_SIZE = 16
BATCH_SIZES = (1, 8, 32, 64)
CONTEXTS = (1024, 8192, 32768)
MOE_TOKENS = (1, 8, 32, 128, 512)
NORM_TOKENS = (1, 64, 512, 4096)
NORM_HIDDEN = 7168  # Kimi
MOE_SHAPES = {  # name -> (experts, top_k, hidden, intermediate)
    "E64 top8 H2048 I1024": (64, 8, 2048, 1024),
    "Kimi TP8 E384 top8 H7168 I256": (384, 8, 7168, 256),
}
REF_MAX_BYTES = 8e9  # skip reference timings whose padded fp32 working set is larger
GOAL_FRACTION = 0.8  # attention GB/s vs copy GB/s at long context
REL_TOL = 1e-2  # bf16 kernels vs references computed in fp32 from the same bf16 inputs
DTYPE = torch.bfloat16


def time_ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


@dataclass
class AttentionRow:
    kernel: str
    batch: int
    context: int
    ms: float
    gbps: float
    fraction_of_copy: float
    ref_ms: float | None
    speedup: float | None
    rel_err: float | None


def _decode_metadata(batch: int, context: int, num_blocks: int, gen: torch.Generator) -> AttentionMetadata:
    """`batch` sequences decoding one token at `context`, on random distinct blocks."""
    blocks = context // BLOCK_SIZE
    tables = torch.randperm(num_blocks, generator=gen, device="cuda")[: batch * blocks].view(batch, blocks)
    positions = torch.full((batch,), context - 1, device="cuda")
    return AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        context_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        block_tables=tables.to(torch.int32),
        slot_mapping=tables.gather(1, (positions // BLOCK_SIZE)[:, None]).squeeze(1) * BLOCK_SIZE + positions % BLOCK_SIZE,
        max_query_len=1,
        max_context_len=context,
    )


def _bench_decode(
    kernel: str,
    run: Callable[[AttentionMetadata], torch.Tensor],
    reference: Callable[[AttentionMetadata], torch.Tensor],
    kv_bytes_per_token: int,
    qo_bytes_per_seq: int,
    ref_bytes_per_token: int,
    num_blocks: int,
    copy_gbps: float,
    batch_sizes: tuple[int, ...],
    contexts: tuple[int, ...],
) -> list[AttentionRow]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for context in contexts:
        for batch in batch_sizes:
            meta = _decode_metadata(batch, context, num_blocks, gen)
            ms = time_ms(lambda: run(meta))
            gbps = (batch * (context * kv_bytes_per_token + qo_bytes_per_seq)) / ms / 1e6
            ref_ms = speedup = err = None
            if batch * context * ref_bytes_per_token <= REF_MAX_BYTES:
                ref_ms = time_ms(lambda: reference(meta))
                speedup = ref_ms / ms
                err = rel_error(run(meta), reference(meta))
            rows.append(AttentionRow(kernel, batch, context, ms, gbps, gbps / copy_gbps, ref_ms, speedup, err))
    return rows


def bench_mha_decode(copy_gbps: float, batch_sizes=BATCH_SIZES, contexts=CONTEXTS,
                     num_heads: int = 8, num_kv_heads: int = 8, head_dim: int = 128) -> list[AttentionRow]:
    num_blocks = max(batch_sizes) * max(contexts) // BLOCK_SIZE + 1
    kv = torch.empty(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=DTYPE, device="cuda").normal_()
    qs = {b: torch.randn(b, num_heads, head_dim, dtype=DTYPE, device="cuda") for b in batch_sizes}
    outs = {b: torch.empty_like(q) for b, q in qs.items()}
    scale = head_dim**-0.5

    def run(meta):
        b = meta.context_lens.shape[0]
        return paged_attention(qs[b], kv[0], kv[1], meta.query_start_loc, meta.context_lens, meta.block_tables,
                               meta.max_query_len, meta.max_context_len, scale, out=outs[b])

    def reference(meta):
        return torch_ref.paged_attention(qs[meta.context_lens.shape[0]], kv[0], kv[1], meta, scale)

    elem = DTYPE.itemsize
    rows = _bench_decode(
        f"MHA {num_heads}/{num_kv_heads}h D{head_dim}", run, reference,
        kv_bytes_per_token=2 * num_kv_heads * head_dim * elem,
        qo_bytes_per_seq=2 * num_heads * head_dim * elem,
        ref_bytes_per_token=2 * num_kv_heads * head_dim * (elem + 4),
        num_blocks=num_blocks, copy_gbps=copy_gbps, batch_sizes=batch_sizes, contexts=contexts,
    )
    del kv
    torch.cuda.empty_cache()
    return rows


def bench_mla_decode(copy_gbps: float, batch_sizes=BATCH_SIZES, contexts=CONTEXTS,
                     num_heads: int = 8, latent: int = 512, rope: int = 64) -> list[AttentionRow]:
    num_blocks = max(batch_sizes) * max(contexts) // BLOCK_SIZE + 1
    kv = torch.empty(num_blocks, BLOCK_SIZE, latent + rope, dtype=DTYPE, device="cuda").normal_()
    qs = {b: torch.randn(b, num_heads, latent + rope, dtype=DTYPE, device="cuda") for b in batch_sizes}
    outs = {b: torch.empty(b, num_heads, latent, dtype=DTYPE, device="cuda") for b in batch_sizes}
    scale = 192**-0.5

    def run(meta):
        b = meta.context_lens.shape[0]
        q = qs[b]
        return mla_paged_attention(q[..., :latent], q[..., latent:], kv, meta.query_start_loc, meta.context_lens,
                                   meta.block_tables, meta.max_query_len, meta.max_context_len, scale, out=outs[b])

    def reference(meta):
        q = qs[meta.context_lens.shape[0]]
        return torch_ref.paged_attention(q, kv.unsqueeze(2), kv[..., :latent].unsqueeze(2), meta, scale)

    elem = DTYPE.itemsize
    rows = _bench_decode(
        f"MLA {num_heads}h L{latent}+R{rope}", run, reference,
        kv_bytes_per_token=(latent + rope) * elem,
        qo_bytes_per_seq=num_heads * (2 * latent + rope) * elem,
        ref_bytes_per_token=(2 * latent + rope) * (elem + 4),
        num_blocks=num_blocks, copy_gbps=copy_gbps, batch_sizes=batch_sizes, contexts=contexts,
    )
    del kv
    torch.cuda.empty_cache()
    return rows


SPLIT_BATCHES, SPLIT_CONTEXTS = (1, 4, 16, 64), (576, 2048, 8192)


def bench_kv_splits(copy_gbps: float) -> list[dict]:
    """Decode attention replayed in a CUDA graph (as the engine runs it) at each forced KV split
    count and the heuristic's own: the Llama-3.1-8B layer (32 q / 8 kv heads, D 128) and one TP8
    rank of Kimi's MLA (8 heads, 512 + 64). Small batches are latency-bound: this says how many
    splits each (batch, context) wants."""
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = max(SPLIT_BATCHES) * max(SPLIT_CONTEXTS) // BLOCK_SIZE + 1
    mha_kv = torch.empty(2, num_blocks, BLOCK_SIZE, 8, 128, dtype=DTYPE, device="cuda").normal_()
    mla_kv = torch.empty(num_blocks, BLOCK_SIZE, 576, dtype=DTYPE, device="cuda").normal_()
    for context in SPLIT_CONTEXTS:
        for batch in SPLIT_BATCHES:
            meta = _decode_metadata(batch, context, num_blocks, gen)
            q_mha = torch.randn(batch, 32, 128, dtype=DTYPE, device="cuda")
            q_mla = torch.randn(batch, 8, 576, dtype=DTYPE, device="cuda")
            out_mha, out_mla = torch.empty_like(q_mha), torch.empty(batch, 8, 512, dtype=DTYPE, device="cuda")
            calls = {
                "MHA 32/8h D128": (lambda n: paged_attention(
                    q_mha, mha_kv[0], mha_kv[1], meta.query_start_loc, meta.context_lens, meta.block_tables, 1, context,
                    128**-0.5, out=out_mha, num_kv_splits=n), 2 * 8 * 128 * 2),
                "MLA 8h L512+R64": (lambda n: mla_paged_attention(
                    q_mla[..., :512], q_mla[..., 512:], mla_kv, meta.query_start_loc, meta.context_lens,
                    meta.block_tables, 1, context, 192**-0.5, out=out_mla, num_kv_splits=n), 576 * 2),
            }
            for kernel, (call, kv_bytes) in calls.items():
                row = dict(kernel=kernel, batch=batch, context=context)
                for n in [None] + [2**i for i in range(8) if 2**i <= min(64, MAX_KV_SPLITS)]:
                    ms = do_bench_cudagraph(lambda: call(n), rep=20, return_mode="median")
                    row["auto" if n is None else str(n)] = 1e3 * ms
                best = min((k for k in row if k.isdigit()), key=lambda k: row[k])
                row.update(best=best, best_fraction_of_copy=batch * context * kv_bytes / (row[best] * 1e-6) / 1e9 / copy_gbps)
                rows.append(row)
    del mha_kv, mla_kv
    torch.cuda.empty_cache()
    return rows


@dataclass
class MoeRow:
    shape: str
    tokens: int
    experts_hit: int
    ms: float
    gbps: float
    fraction_of_copy: float
    tflops: float
    ref_ms: float
    speedup: float
    rel_err: float


def bench_moe(copy_gbps: float, shapes: dict[str, tuple[int, int, int, int]] | None = None,
              token_counts=MOE_TOKENS) -> list[MoeRow]:
    rows = []
    for name, (num_experts, top_k, hidden, inter) in (shapes or MOE_SHAPES).items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=DTYPE, device="cuda").normal_(std=hidden**-0.5)
        w2 = torch.empty(num_experts, hidden, inter, dtype=DTYPE, device="cuda").normal_(std=inter**-0.5)
        w13_fp32, w2_fp32 = w13.float(), w2.float()  # oracle for the error check; the timed loop is bf16
        for tokens in token_counts:
            x = torch.randn(tokens, hidden, generator=gen, dtype=DTYPE, device="cuda")
            scores = torch.rand(tokens, num_experts, generator=gen, device="cuda")
            weights, ids = scores.topk(top_k, dim=-1)
            weights = (weights / weights.sum(-1, keepdim=True)).contiguous()
            ids = ids.to(torch.int32).contiguous()
            out = torch.empty_like(x)
            ms = time_ms(lambda: fused_moe(x, w13, w2, weights, ids, out=out))
            ref_ms = time_ms(lambda: moe_reference(x, w13, w2, weights, ids))
            err = rel_error(fused_moe(x, w13, w2, weights, ids), moe_reference(x.float(), w13_fp32, w2_fp32, weights, ids))
            hit = int(torch.unique(ids).numel())
            num_bytes = hit * 3 * inter * hidden * DTYPE.itemsize + 2 * tokens * hidden * DTYPE.itemsize
            gbps = num_bytes / ms / 1e6
            tflops = 6 * tokens * top_k * hidden * inter / ms / 1e9
            rows.append(MoeRow(name, tokens, hit, ms, gbps, gbps / copy_gbps, tflops, ref_ms, ref_ms / ms, err))
        del w13, w2, w13_fp32, w2_fp32
        torch.cuda.empty_cache()
    return rows


@dataclass
class NormRow:
    tokens: int
    ms: float
    gbps: float
    fraction_of_copy: float
    eager_ms: float
    speedup: float
    rel_err: float


def bench_rms_norm(copy_gbps: float, hidden: int = NORM_HIDDEN, token_counts=NORM_TOKENS) -> list[NormRow]:
    """fused_add_rms_norm vs eager `x + residual` then RMSNorm; bytes = x, residual, weight read +
    residual, out written."""
    rows = []
    eps = 1e-6
    for tokens in token_counts:
        x, residual = torch.randn(2, tokens, hidden, dtype=DTYPE, device="cuda")
        weight = torch.randn(hidden, dtype=DTYPE, device="cuda")
        out = torch.empty_like(x)
        ms = time_ms(lambda: fused_add_rms_norm(x, residual, weight, eps, out=out))
        eager_ms = time_ms(lambda: rms_norm_reference(x + residual, weight, eps))
        expected = rms_norm_reference(x + residual, weight, eps)
        err = rel_error(fused_add_rms_norm(x, residual.clone(), weight, eps)[0], expected)
        gbps = (4 * tokens + 1) * hidden * DTYPE.itemsize / ms / 1e6
        rows.append(NormRow(tokens, ms, gbps, gbps / copy_gbps, eager_ms, eager_ms / ms, err))
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def to_markdown(results: dict) -> str:
    copy = results["copy"]
    lines = [
        f"# Kernel benchmarks: {results['device']}",
        "",
        f"torch {results['torch']}, triton {results['triton']}. Copy bandwidth (read + write): "
        f"**{copy['gbps']:.0f} GB/s**. Medians of do_bench; GB/s counts KV (or touched expert weights) "
        "+ activations once.",
        "",
        "## Decode attention (block 16, one query token per sequence)",
        "",
        "| kernel | batch | context | µs | GB/s | % of copy | ref µs | speedup | rel err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["attention"]:
        lines.append(
            f"| {r['kernel']} | {r['batch']} | {r['context']} | {r['ms'] * 1e3:.1f} | {r['gbps']:.0f} | "
            f"{r['fraction_of_copy'] * 100:.0f}% | {_fmt(r['ref_ms'] and r['ref_ms'] * 1e3, '.1f')} | "
            f"{_fmt(r['speedup'], '.1f')} | {_fmt(r['rel_err'], '.1e')} |"
        )
    lines += [
        "",
        "## Fused MoE (bf16)",
        "",
        "| shape | T | experts hit | µs | GB/s | % of copy | TFLOPS | loop µs | speedup | rel err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["moe"]:
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['experts_hit']} | {r['ms'] * 1e3:.1f} | {r['gbps']:.0f} | "
            f"{r['fraction_of_copy'] * 100:.0f}% | {r['tflops']:.1f} | {r['ref_ms'] * 1e3:.0f} | "
            f"{r['speedup']:.1f} | {r['rel_err']:.1e} |"
        )
    lines += [
        "",
        f"## Fused residual add + RMSNorm (H={NORM_HIDDEN})",
        "",
        "| T | µs | GB/s | % of copy | eager µs | speedup | rel err |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rms_norm"]:
        lines.append(
            f"| {r['tokens']} | {r['ms'] * 1e3:.1f} | {r['gbps']:.0f} | {r['fraction_of_copy'] * 100:.0f}% | "
            f"{r['eager_ms'] * 1e3:.1f} | {r['speedup']:.1f} | {r['rel_err']:.1e} |"
        )
    lines += ["", "## Checks", ""]
    lines += [f"- {line}" for line in results["summary"]]
    return "\n".join(lines) + "\n"


def _summarize(
    attention: list[AttentionRow], moe: list[MoeRow], norms: list[NormRow]
) -> tuple[list[str], list[str]]:
    """(summary lines, failures). Correctness failures fail the run; the bandwidth goal is reported."""
    failures = [
        f"{r.kernel} batch {r.batch} ctx {r.context}: rel err {r.rel_err:.2e} > {REL_TOL}"
        for r in attention if r.rel_err is not None and not r.rel_err <= REL_TOL
    ] + [
        f"MoE {r.shape} T={r.tokens}: rel err {r.rel_err:.2e} > {REL_TOL}"
        for r in moe if not r.rel_err <= REL_TOL
    ] + [
        f"RMSNorm T={r.tokens}: rel err {r.rel_err:.2e} > {REL_TOL}"
        for r in norms if not r.rel_err <= REL_TOL
    ]
    summary = []
    long_context = max(r.context for r in attention)
    for kernel in dict.fromkeys(r.kernel for r in attention):
        best = max((r for r in attention if r.kernel == kernel and r.context == long_context),
                   key=lambda r: r.fraction_of_copy)
        verdict = "meets" if best.fraction_of_copy >= GOAL_FRACTION else "misses"
        summary.append(
            f"{kernel} at context {long_context}: best {best.fraction_of_copy * 100:.0f}% of copy bandwidth "
            f"(batch {best.batch}) — {verdict} the {GOAL_FRACTION * 100:.0f}% goal"
        )
    summary.append("correctness: all checks passed" if not failures else f"correctness: {len(failures)} FAILED")
    return summary + failures, failures


def run_all(out_dir: Path, quick: bool = False) -> dict:
    """Run every benchmark, write bench_kernels.{json,md} to `out_dir`, return the results dict."""
    batch_sizes, contexts = ((1, 32), (8192,)) if quick else (BATCH_SIZES, CONTEXTS)
    moe_tokens = (1, 128) if quick else MOE_TOKENS
    copy = measure_copy_bandwidth()
    attention = bench_mha_decode(copy["gbps"], batch_sizes, contexts) + bench_mla_decode(copy["gbps"], batch_sizes, contexts)
    moe = bench_moe(copy["gbps"], token_counts=moe_tokens)
    norms = bench_rms_norm(copy["gbps"], token_counts=(1, 4096) if quick else NORM_TOKENS)
    summary, failures = _summarize(attention, moe, norms)
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy": copy,
        "attention": [asdict(r) for r in attention],
        "moe": [asdict(r) for r in moe],
        "rms_norm": [asdict(r) for r in norms],
        "summary": summary,
        "failures": failures,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_kernels.json").write_text(json.dumps(results, indent=2))
    (out_dir / "bench_kernels.md").write_text(to_markdown(results))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    parser.add_argument("--quick", action="store_true", help="a few configurations only (smoke run)")
    parser.add_argument("--splits", action="store_true", help="only the decode-attention KV split sweep (graphs, µs)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA/ROCm GPU available", file=sys.stderr)
        return 2
    if args.splits:
        rows = bench_kv_splits(measure_copy_bandwidth()["gbps"])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_splits.json").write_text(json.dumps(rows, indent=1))
        keys = [k for k in rows[0] if k not in ("kernel", "batch", "context", "best", "best_fraction_of_copy")]
        print("| kernel | batch | context | " + " | ".join(f"{k} µs" for k in keys) + " | best | best % copy |")
        for r in rows:
            print(f"| {r['kernel']} | {r['batch']} | {r['context']} | " + " | ".join(f"{r[k]:.1f}" for k in keys)
                  + f" | {r['best']} | {r['best_fraction_of_copy']:.0%} |")
        return 0
    results = run_all(args.out, args.quick)
    print(to_markdown(results))
    print(f"wrote {args.out / 'bench_kernels.json'} and {args.out / 'bench_kernels.md'}")
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
