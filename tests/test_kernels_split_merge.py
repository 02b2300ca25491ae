"""The split-KV merge (SplitBuffers.merge_into) on its own, against the formula in torch.

The attention tests reach the merge only through the kernels' own partials; here the partials are
random, with empty segments (max -inf, sum 0) mixed in and one row with no keys at all, at every
split count the policy can pick and at the head dims the engine merges (MHA 80 / 128, MLA 512) plus
576 (head_pad 1024: most padding slices skipped).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kernels_rocm._attention_common import MAX_KV_SPLITS, SplitBuffers

NUM_TOKENS, NUM_HEADS = 2, 3
SEGMENT_COUNTS = [2**i for i in range(MAX_KV_SPLITS.bit_length())]  # 1 .. 128


def _random_partials(num_segments: int, head_dim: int, gen: torch.Generator) -> SplitBuffers:
    head_pad = max(16, 1 << (head_dim - 1).bit_length())
    split = SplitBuffers(NUM_TOKENS, NUM_HEADS, num_segments, head_pad, torch.device("cpu"))
    split.acc.copy_(torch.randn(split.acc.shape, generator=gen))
    split.acc[..., head_dim:] = 0.0  # the attention kernels write zeros past head_dim
    split.max.copy_(4 * torch.randn(split.max.shape, generator=gen))
    split.sum.copy_(torch.rand(split.sum.shape, generator=gen) + 0.5)
    empty = torch.rand(split.max.shape, generator=gen) < 0.3  # segments past a short context
    empty[0, 1] = True  # a row with no keys at all (all its segments empty)
    split.max[empty] = float("-inf")
    split.sum[empty] = 0.0
    # An empty segment's acc is zeros in the kernels; random here so a non-zero weight shows.
    return split


def _reference(split: SplitBuffers, head_dim: int) -> torch.Tensor:
    global_max = split.max.amax(-1, keepdim=True)
    global_max = torch.where(global_max == float("-inf"), 0.0, global_max)
    weights = torch.exp2(split.max - global_max)
    denom = (weights * split.sum).sum(-1, keepdim=True)
    acc = (weights[..., None] * split.acc[..., :head_dim]).sum(-2)
    return acc / torch.where(denom > 0, denom, 1.0)


@pytest.mark.parametrize("head_dim", [80, 128, 512, 576])
@pytest.mark.parametrize("num_segments", SEGMENT_COUNTS)
def test_merge_matches_formula(num_segments, head_dim):
    gen = torch.Generator().manual_seed(num_segments * 1000 + head_dim)
    split = _random_partials(num_segments, head_dim, gen)
    # Strided output (token and head strides are not head_dim multiples); the columns past
    # head_dim must stay untouched.
    buffer = torch.full((NUM_TOKENS, NUM_HEADS + 1, head_dim + 8), float("nan"))
    out = buffer[:, 1:, :head_dim]
    split.merge_into(out, head_dim)
    expected = _reference(split, head_dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert (out[0, 1] == 0).all()  # the empty row
    assert buffer[:, 0].isnan().all() and buffer[..., head_dim:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_writes_out_dtype(dtype):
    gen = torch.Generator().manual_seed(7)
    split = _random_partials(16, 128, gen)
    out = torch.full((NUM_TOKENS, NUM_HEADS, 128), float("nan"), dtype=dtype)
    split.merge_into(out, 128)
    torch.testing.assert_close(out, _reference(split, 128).to(dtype))


def test_bench_merge_smoke(capsys):
    """ci/bench_merge.py --smoke: the former loop kernel kept there and the wide-slice variants
    agree with the formula too, so the GPU comparison measures equal work."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ci"))
    import bench_merge

    assert bench_merge.main(["--smoke"]) == 0
    assert "every variant matches" in capsys.readouterr().out
