"""The split-KV merge alone (SplitBuffers.merge_into), before and after its tiling, on one GPU.

Shapes: one TP8 rank of Kimi-K2.5's MLA (8 heads, latent 512) at 1 and 4 tokens, and the
Llama-3.1-8B layer (32 heads, head dim 128) at 1 token, at the split counts the policy picks at
small batch (kernels_rocm/_attention_common.py). Variants, same run and same partials:
- `loop`: the former kernel (one program per (token, head) walking the segments one after
  another), kept in this script only;
- `tiled`: the production kernel with its own launch config (BLOCK_D 32);
- `tiled BLOCK_D 64 / 128`: the production kernel with wider slices (fewer programs), to check
  the choice.
Each time is the median per call of do_bench_cudagraph (calls unrolled in one CUDA graph, as a
decode step replays them; partials L2-resident as after the attention kernel). Every variant's
output is checked against the formula in torch first; a mismatch makes the run exit 1.

Usage: python ci/bench_merge.py [--out DIR] (`ci/gpu_check.sh merge`; under a minute); DIR
defaults to $OUT or ./bench_out. Prints a markdown table and writes bench_merge.{json,md} there.
`--smoke` checks every variant at tiny shapes without timing (runs on CPU under
TRITON_INTERPRET=1; tests/test_kernels_split_merge.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels_rocm import _pdl as pdl  # noqa: E402
from kernels_rocm._attention_common import SplitBuffers, _merge_segments_kernel, merge_launch_config  # noqa: E402
from kernels_rocm._pdl import wait_for_previous_kernel  # noqa: E402

# name -> (tokens, heads, head_dim, segment counts)
SHAPES = {
    "Kimi TP8 MLA": [(1, 8, 512, (32, 64, 128)), (4, 8, 512, (32, 64, 128))],
    "Llama-8B MHA": [(1, 32, 128, (32, 64))],
}
SMOKE_SHAPES = {"smoke MLA": [(2, 2, 512, (4, 128))], "smoke MHA": [(1, 3, 80, (1, 16))]}
WIDE_BLOCK_D = (64, 128)
VALUES_PER_THREAD = 32  # the wide variants' warps: the same register budget as the production tile


@triton.jit
def _merge_segments_loop_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
    stride_out_t: tl.int64, stride_out_h: tl.int64, num_heads,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """The merge before its tiling (main up to 138272c), for comparison only."""
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * num_heads + head) * NUM_SEGMENTS
    segments = tl.arange(0, NUM_SEGMENTS)
    seg_max = tl.load(part_max_ptr + base + segments)
    seg_sum = tl.load(part_sum_ptr + base + segments)
    global_max = tl.max(seg_max, axis=0)
    global_max = tl.where(global_max == float("-inf"), 0.0, global_max)
    weights = tl.exp2(seg_max - global_max)
    denom = tl.sum(weights * seg_sum, axis=0)
    offs_d = tl.arange(0, HEAD_PAD)
    acc = tl.zeros([HEAD_PAD], dtype=tl.float32)
    for s in range(NUM_SEGMENTS):
        w = tl.exp2(tl.load(part_max_ptr + base + s) - global_max)
        acc += w * tl.load(part_acc_ptr + (base + s) * HEAD_PAD + offs_d)
    out = acc / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + token * stride_out_t + head * stride_out_h + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def _loop(split: SplitBuffers, out: torch.Tensor, head_dim: int) -> None:
    tokens, heads, segments, head_pad = split.acc.shape
    _merge_segments_loop_kernel[(tokens, heads)](
        split.acc, split.max, split.sum, out, out.stride(0), out.stride(1), heads,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SEGMENTS=segments, **pdl.launch_args(out.device))


def _tiled_with(block_d: int):
    def run(split: SplitBuffers, out: torch.Tensor, head_dim: int) -> None:
        tokens, heads, segments, head_pad = split.acc.shape
        warps = max(1, min(8, segments * block_d // (32 * VALUES_PER_THREAD)))
        _merge_segments_kernel[(tokens, heads, triton.cdiv(head_dim, block_d))](
            split.acc, split.max, split.sum, out, out.stride(0), out.stride(1), heads,
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SEGMENTS=segments, BLOCK_D=block_d, num_warps=warps,
            **pdl.launch_args(out.device))
    return run


def variants() -> dict:
    return {"loop": _loop, "tiled": lambda split, out, head_dim: split.merge_into(out, head_dim)} | {
        f"tiled BLOCK_D {d}": _tiled_with(d) for d in WIDE_BLOCK_D}


def random_partials(tokens: int, heads: int, segments: int, head_dim: int, device: str) -> SplitBuffers:
    """Partials as the attention kernels leave them: zeros past head_dim; about a quarter of the
    segments empty (max -inf, sum 0, acc 0), as past a short context."""
    gen = torch.Generator(device=device).manual_seed(segments)
    split = SplitBuffers(tokens, heads, segments, max(16, triton.next_power_of_2(head_dim)), torch.device(device))
    split.acc.normal_(generator=gen)
    split.acc[..., head_dim:] = 0.0
    split.max.normal_(std=4.0, generator=gen)
    split.sum.uniform_(0.5, 1.5, generator=gen)
    empty = torch.rand(split.max.shape, generator=gen, device=device) < 0.25
    split.max[empty], split.sum[empty] = float("-inf"), 0.0
    split.acc[empty] = 0.0
    return split


def reference(split: SplitBuffers, head_dim: int) -> torch.Tensor:
    global_max = split.max.amax(-1, keepdim=True)
    weights = torch.exp2(split.max - torch.where(global_max == float("-inf"), 0.0, global_max))
    denom = (weights * split.sum).sum(-1, keepdim=True)
    return (weights[..., None] * split.acc[..., :head_dim]).sum(-2) / torch.where(denom > 0, denom, 1.0)


def run(shapes: dict, device: str, timed: bool) -> tuple[list[dict], list[str]]:
    """(rows, failures): one row per shape and split count, µs per variant when `timed`."""
    from triton.testing import do_bench_cudagraph

    rows, failures = [], []
    for name, cases in shapes.items():
        for tokens, heads, head_dim, segment_counts in cases:
            out = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16, device=device)
            for segments in segment_counts:
                split = random_partials(tokens, heads, segments, head_dim, device)
                expected = reference(split, head_dim)
                block_d, warps = merge_launch_config(segments, split.acc.shape[3])
                row = dict(shape=name, tokens=tokens, heads=heads, head_dim=head_dim, segments=segments,
                           programs=tokens * heads * triton.cdiv(head_dim, block_d), warps=warps)
                for variant, merge in variants().items():
                    out.fill_(float("nan"))
                    merge(split, out, head_dim)
                    err = ((out.float() - expected).norm() / expected.norm()).item()
                    if not err <= 1e-2:  # bf16 output
                        failures.append(f"{variant} {name} T={tokens} S={segments}: rel err {err:.2e}")
                    if timed:
                        row[variant] = 1e3 * do_bench_cudagraph(lambda: merge(split, out, head_dim), rep=20,
                                                                 return_mode="median")
                rows.append(row)
    return rows, failures


def to_markdown(rows: list[dict], device: str) -> str:
    names = list(variants())
    lines = [f"# Split-KV merge alone: {device}", "",
             "| shape | T | H | D | segments | programs (tiled) | warps | " + " | ".join(f"{n} µs" for n in names)
             + " | loop / tiled |",
             "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * (len(names) + 1)]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['heads']} | {r['head_dim']} | {r['segments']} | "
                     f"{r['programs']} | {r['warps']} | " + " | ".join(f"{r[n]:.2f}" for n in names)
                     + f" | {r['loop'] / r['tiled']:.1f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    parser.add_argument("--smoke", action="store_true", help="check every variant at tiny shapes, no timing")
    args = parser.parse_args(argv)
    if args.smoke:
        _, failures = run(SMOKE_SHAPES, "cuda" if torch.cuda.is_available() else "cpu", timed=False)
        print("\n".join(failures) or "bench_merge smoke: every variant matches the formula")
        return 1 if failures else 0
    if not torch.cuda.is_available():
        print("bench_merge: no CUDA/ROCm GPU available", file=sys.stderr)
        return 2
    rows, failures = run(SHAPES, "cuda", timed=True)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    meta = dict(device=device, torch=torch.__version__, triton=triton.__version__,
                pdl=pdl.launch_args(torch.device("cuda"))["PDL"])
    (args.out / "bench_merge.json").write_text(json.dumps(dict(meta=meta, rows=rows, failures=failures), indent=1))
    (args.out / "bench_merge.md").write_text(to_markdown(rows, device))
    print(to_markdown(rows, device))
    print("\n".join(failures) or "correctness: every variant matches the formula")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
