"""Verify steps with k > 3 drafts (adaptive speculation allows up to 8: query lengths up to 9 per
sequence) through the Triton MHA and MLA paged-attention kernels, with block ids past 65,535,
against the pure-PyTorch reference (Triton interpreter on CPU). aiter's MLA decode takes only
1, 2 or 4 query rows (kernels_rocm/aiter_ops.py: MLA_QUERY_LENS), so these widths run on Triton
on every backend. ~10 s (the pools hold 66,048 small blocks, as tests/test_kernels_large_block_ids.py's)."""
from __future__ import annotations

import pytest
import torch

from _kernel_cases import make_metadata, metadata_args, nan_like
from kernels_rocm.kv_cache import write_kv_cache, write_mla_kv_cache
from kernels_rocm.mla_decode import mla_paged_attention
from kernels_rocm.paged_attention import paged_attention
from model_ops.attention import torch_ref

NUM_BLOCKS = 65_536 + 512
FIRST_HIGH_BLOCK = 65_536
BLOCK_SIZE = 16
# verify widths k + 1 for k = 8, 5, 4 and 7 next to a plain decode row; contexts across block edges
Q_LENS, CTX_LENS = [9, 6, 1, 5, 8], [40, 17, 33, 9, 70]


@pytest.fixture(scope="module")
def meta():
    meta = make_metadata(Q_LENS, CTX_LENS, BLOCK_SIZE, NUM_BLOCKS, torch.Generator().manual_seed(4), FIRST_HIGH_BLOCK)
    assert int(meta.block_tables[meta.block_tables >= 0].min()) >= FIRST_HIGH_BLOCK and meta.max_query_len == 9
    return meta


def test_mha_verify_width_up_to_9(meta):
    g = torch.Generator().manual_seed(5)
    n, dim = sum(Q_LENS), 16
    k_cache, v_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, dim, generator=g)
    key, value = torch.randn(2, n, 2, dim, generator=g)
    write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache.flatten(0, 1)[meta.slot_mapping], key)
    q = torch.randn(n, 6, dim, generator=g)  # GQA 3:1
    expected = torch_ref.paged_attention(q, k_cache, v_cache, meta, 0.25)
    for splits in (1, 4):
        out = paged_attention(q, k_cache, v_cache, *metadata_args(meta), 0.25, out=nan_like(q), num_kv_splits=splits)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_mla_verify_width_up_to_9(meta):
    g = torch.Generator().manual_seed(6)
    n, latent, rope, heads = sum(Q_LENS), 8, 8, 4
    kv_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, latent + rope, generator=g)
    c_kv, k_pe = torch.randn(n, latent, generator=g), torch.randn(n, rope, generator=g)
    write_mla_kv_cache(c_kv, k_pe, kv_cache, meta.slot_mapping)
    assert torch.equal(kv_cache.flatten(0, 1)[meta.slot_mapping], torch.cat([c_kv, k_pe], dim=-1))
    q_latent, q_pe = torch.randn(n, heads, latent, generator=g), torch.randn(n, heads, rope, generator=g)
    expected = torch_ref.paged_attention(torch.cat([q_latent, q_pe], -1), kv_cache.unsqueeze(2),
                                         kv_cache[..., :latent].unsqueeze(2), meta, 0.2)
    for splits in (1, 4):
        out = mla_paged_attention(q_latent, q_pe, kv_cache, *metadata_args(meta), 0.2, out=nan_like(q_latent),
                                  num_kv_splits=splits)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
