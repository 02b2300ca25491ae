"""kernels_rocm.mla_decode (absorbed MLA over latent rows) against the pure-PyTorch paged reference."""
from __future__ import annotations

import pytest
import torch

from _kernel_cases import BATCHES, make_metadata, metadata_args, nan_like
from kernels_rocm.mla_decode import mla_paged_attention
from model_ops.attention import torch_ref

NUM_BLOCKS = 96
LATENT, ROPE = 32, 16
SCALE = 0.2


def mla_reference(q_latent, q_pe, kv_cache, meta, scale):
    """MQA over one latent "head"; values are the first L columns of the same rows."""
    latent = q_latent.shape[-1]
    return torch_ref.paged_attention(
        torch.cat([q_latent, q_pe], dim=-1), kv_cache.unsqueeze(2), kv_cache[..., :latent].unsqueeze(2), meta, scale
    )


def _run_case(batch, num_heads, block_size, num_kv_splits, latent=LATENT, rope=ROPE, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_lens, ctx_lens = BATCHES[batch]
    meta = make_metadata(q_lens, ctx_lens, block_size, NUM_BLOCKS, g)
    kv_cache = torch.randn(NUM_BLOCKS, block_size, latent + rope, generator=g)
    q_latent = torch.randn(sum(q_lens), num_heads, latent, generator=g)
    q_pe = torch.randn(sum(q_lens), num_heads, rope, generator=g)
    expected = mla_reference(q_latent, q_pe, kv_cache, meta, SCALE)
    out = nan_like(q_latent.to(dtype))
    mla_paged_attention(
        q_latent.to(dtype), q_pe.to(dtype), kv_cache.to(dtype), *metadata_args(meta), SCALE,
        out=out, num_kv_splits=num_kv_splits,
    )
    return out.float(), expected


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("num_heads", [4, 16])
@pytest.mark.parametrize("num_kv_splits", [1, 8], ids=["split1", "split8"])  # None: see test_split_policy
def test_matches_reference(batch, num_heads, num_kv_splits):
    out, expected = _run_case(batch, num_heads, 16, num_kv_splits)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_heads", [20, 3], ids=["two_head_groups", "odd_heads"])
def test_head_groups(num_heads):
    # 20 heads = a full group of 16 plus a partial one; 3 heads pad the head axis.
    out, expected = _run_case("mixed", num_heads, 16, 4, seed=1)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size", [8, 64])
def test_block_sizes(block_size):
    out, expected = _run_case("verify_4", 8, block_size, 2, seed=2)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_non_power_of_two_dims():
    out, expected = _run_case("mixed", 8, 16, 4, latent=40, rope=24, seed=3)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_strided_cache_view():
    # One layer of a [layers, NB, BS, L+R] pool.
    g = torch.Generator().manual_seed(4)
    q_lens, ctx_lens = BATCHES["verify_2"]
    meta = make_metadata(q_lens, ctx_lens, 16, NUM_BLOCKS, g)
    pool = torch.randn(3, NUM_BLOCKS, 16, LATENT + ROPE, generator=g)
    q_latent = torch.randn(sum(q_lens), 8, LATENT, generator=g)
    q_pe = torch.randn(sum(q_lens), 8, ROPE, generator=g)
    out = mla_paged_attention(q_latent, q_pe, pool[2], *metadata_args(meta), SCALE, out=nan_like(q_latent))
    torch.testing.assert_close(out, mla_reference(q_latent, q_pe, pool[2], meta, SCALE), atol=2e-5, rtol=2e-5)


def test_bfloat16():
    out, expected = _run_case("mixed", 8, 16, 4, dtype=torch.bfloat16, seed=5)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)


def test_default_split_policy_on_long_context():
    g = torch.Generator().manual_seed(6)
    meta = make_metadata([1, 2], [600, 900], 16, NUM_BLOCKS, g)
    kv_cache = torch.randn(NUM_BLOCKS, 16, LATENT + ROPE, generator=g)
    q_latent = torch.randn(3, 4, LATENT, generator=g)
    q_pe = torch.randn(3, 4, ROPE, generator=g)
    out = mla_paged_attention(q_latent, q_pe, kv_cache, *metadata_args(meta), SCALE, out=nan_like(q_latent))
    torch.testing.assert_close(out, mla_reference(q_latent, q_pe, kv_cache, meta, SCALE), atol=2e-5, rtol=2e-5)
