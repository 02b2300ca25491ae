"""kernels_rocm.paged_attention (MHA/GQA) against the pure-PyTorch paged reference."""
from __future__ import annotations

import pytest
import torch

from _kernel_cases import BATCHES, make_metadata, metadata_args, nan_like
from kernels_rocm.paged_attention import paged_attention
from model_ops.attention import torch_ref

NUM_BLOCKS = 96
HEAD_DIM = 32
SCALE = 0.3


def _run_case(batch, num_heads, num_kv_heads, block_size, num_kv_splits, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = BATCHES[batch]
    meta = make_metadata(q_lens, ctx_lens, block_size, NUM_BLOCKS, g)
    k_cache = torch.randn(NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM, generator=g)
    v_cache = torch.randn(NUM_BLOCKS, block_size, num_kv_heads, HEAD_DIM, generator=g)
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=g)
    expected = torch_ref.paged_attention(q, k_cache, v_cache, meta, SCALE)
    out = nan_like(q.to(dtype))
    result = paged_attention(
        q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), *metadata_args(meta), SCALE,
        out=out, num_kv_splits=num_kv_splits,
    )
    assert result is out
    return out.float(), expected


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("num_kv_splits", [1, 8], ids=["split1", "split8"])  # None: see test_split_policy
def test_matches_reference(batch, num_heads, num_kv_heads, num_kv_splits):
    out, expected = _run_case(batch, num_heads, num_kv_heads, 16, num_kv_splits)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size", [8, 32, 64])
@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_block_sizes(block_size, num_kv_splits):
    out, expected = _run_case("mixed", 6, 2, block_size, num_kv_splits, seed=1)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_prefill_uses_wide_m_tile():
    # 40 rows x group 3 >= 128 selects BLOCK_M = 64 (21 rows per q block): cross-block causal masks.
    g = torch.Generator().manual_seed(2)
    q_lens, ctx_lens = [40, 3], [50, 3]
    meta = make_metadata(q_lens, ctx_lens, 16, NUM_BLOCKS, g)
    k_cache, v_cache = torch.randn(2, NUM_BLOCKS, 16, 2, HEAD_DIM, generator=g)
    q = torch.randn(sum(q_lens), 6, HEAD_DIM, generator=g)
    out = paged_attention(q, k_cache, v_cache, *metadata_args(meta), SCALE, out=nan_like(q))
    torch.testing.assert_close(out, torch_ref.paged_attention(q, k_cache, v_cache, meta, SCALE), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,q_len", [(8, 2, 5), (8, 2, 6), (16, 2, 9), (6, 2, 7)],
                         ids=["group4-k4", "group4-k5", "group8-k8", "group3-k6"])
@pytest.mark.parametrize("num_seqs", [12, 4], ids=["one-tile", "row-blocks"])
def test_verify_rows_of_a_sequence_in_one_program(num_heads, num_kv_heads, q_len, num_seqs):
    # From 5 (sequence, KV head) programs a compute unit (the interpreter counts 4 units: 12 sequences
    # x 2 KV heads are enough, 4 x 2 are not), k + 1 rows x group up to 64 take one M tile (32 or 64 rows, padded rows masked),
    # group 8 x 9 rows = 72 two of 64; with 4 sequences the rows stay in blocks of 16 / group. Decode
    # rows and shorter widths in the same batch.
    g = torch.Generator().manual_seed(q_len)
    q_lens = ([q_len, 1, q_len, 3] * 3)[:num_seqs]
    ctx_lens = [q_len + 40, 17, q_len + 2, 70, q_len + 9, 5, q_len + 33, 3, q_len, 1, q_len + 60, 21][:num_seqs]
    meta = make_metadata(q_lens, ctx_lens, 16, NUM_BLOCKS, g)
    k_cache, v_cache = torch.randn(2, NUM_BLOCKS, 16, num_kv_heads, HEAD_DIM, generator=g)
    q = torch.randn(sum(q_lens), num_heads, HEAD_DIM, generator=g)
    for splits in (1, 4):
        out = paged_attention(q, k_cache, v_cache, *metadata_args(meta), SCALE, out=nan_like(q), num_kv_splits=splits)
        torch.testing.assert_close(out, torch_ref.paged_attention(q, k_cache, v_cache, meta, SCALE), atol=2e-5, rtol=2e-5)


def test_head_dim_64_not_power_of_two_heads():
    # SmolLM2-like 9 q heads / 3 kv heads at head dim 64.
    g = torch.Generator().manual_seed(3)
    q_lens, ctx_lens = [1, 2, 5], [30, 41, 5]
    meta = make_metadata(q_lens, ctx_lens, 16, NUM_BLOCKS, g)
    k_cache, v_cache = torch.randn(2, NUM_BLOCKS, 16, 3, 64, generator=g)
    q = torch.randn(sum(q_lens), 9, 64, generator=g)
    out = paged_attention(q, k_cache, v_cache, *metadata_args(meta), 0.125, out=nan_like(q), num_kv_splits=2)
    torch.testing.assert_close(out, torch_ref.paged_attention(q, k_cache, v_cache, meta, 0.125), atol=2e-5, rtol=2e-5)


def test_strided_pool_views_and_output():
    # Caches as pool[kind, layer] of a [2, L, NB, BS, H, D] pool; output is a column slice.
    g = torch.Generator().manual_seed(4)
    q_lens, ctx_lens = BATCHES["mixed"]
    meta = make_metadata(q_lens, ctx_lens, 16, NUM_BLOCKS, g)
    pool = torch.randn(2, 3, NUM_BLOCKS, 16, 2, HEAD_DIM, generator=g)
    k_cache, v_cache = pool[0, 1], pool[1, 1]
    q = torch.randn(sum(q_lens), 8, HEAD_DIM + 8, generator=g)[..., :HEAD_DIM]
    out = torch.full((sum(q_lens), 8, HEAD_DIM + 16), float("nan"))[..., :HEAD_DIM]
    paged_attention(q, k_cache, v_cache, *metadata_args(meta), SCALE, out=out, num_kv_splits=4)
    expected = torch_ref.paged_attention(q, k_cache.contiguous(), v_cache.contiguous(), meta, SCALE)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    out, expected = _run_case("mixed", 6, 2, 16, 4, dtype=dtype, seed=5)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)


def test_default_split_policy_on_long_context():
    # One sequence at 600 tokens: the host policy picks 2 splits here (see test_split_policy).
    g = torch.Generator().manual_seed(6)
    meta = make_metadata([1], [600], 16, NUM_BLOCKS, g)
    k_cache, v_cache = torch.randn(2, NUM_BLOCKS, 16, 2, HEAD_DIM, generator=g)
    q = torch.randn(1, 4, HEAD_DIM, generator=g)
    out = paged_attention(q, k_cache, v_cache, *metadata_args(meta), SCALE, out=nan_like(q))
    torch.testing.assert_close(out, torch_ref.paged_attention(q, k_cache, v_cache, meta, SCALE), atol=2e-5, rtol=2e-5)
