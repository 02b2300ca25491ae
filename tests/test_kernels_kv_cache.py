"""kernels_rocm.kv_cache writes against torch_ref.write_cache."""
from __future__ import annotations

import pytest
import torch

from kernels_rocm.kv_cache import write_kv_cache, write_mla_kv_cache
from model_ops.attention import torch_ref


def _slots(num_tokens, num_blocks, block_size, g, skip=(1, 4)):
    """Distinct random slots, with -1 (skip) at the `skip` token indices."""
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[list(skip)] = -1
    return slots


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_dims", [(32, 32), (64, 48)], ids=["same_dim", "value_dim_differs"])
def test_write_kv_cache(block_size, head_dims):
    g = torch.Generator().manual_seed(0)
    num_blocks, num_tokens, heads = 12, 9, 3
    dim_k, dim_v = head_dims
    key = torch.randn(num_tokens, heads, dim_k, generator=g)
    value = torch.randn(num_tokens, heads, dim_v, generator=g)
    k_cache = torch.randn(num_blocks, block_size, heads, dim_k, generator=g)
    v_cache = torch.randn(num_blocks, block_size, heads, dim_v, generator=g)
    slots = _slots(num_tokens, num_blocks, block_size, g)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    torch_ref.write_cache(k_expected, key, slots)
    torch_ref.write_cache(v_expected, value, slots)

    write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


def test_write_key_only_into_pool_view_with_cast():
    # bf16 cache that is one layer of a [2, layers, NB, BS, H, D] pool; fp32 keys are cast on store
    # (the interpreter truncates to bf16 where torch and compiled Triton round: allow one ulp).
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(2, 3, 10, 16, 2, 32, generator=g).to(torch.bfloat16)
    k_cache = pool[0, 2]
    key = torch.randn(7, 2, 32, generator=g)
    slots = _slots(7, 10, 16, g, skip=(0,))
    expected = pool.clone()
    torch_ref.write_cache(expected[0, 2], key, slots)

    write_kv_cache(key, None, k_cache, None, slots)
    torch.testing.assert_close(pool, expected, atol=0, rtol=2**-7)


def test_write_mla_kv_cache():
    g = torch.Generator().manual_seed(2)
    num_blocks, block_size, latent, rope, num_tokens = 10, 16, 40, 24, 11
    c_kv = torch.randn(num_tokens, latent + 8, generator=g)[:, :latent]  # strided rows
    k_pe = torch.randn(num_tokens, rope, generator=g)
    kv_cache = torch.randn(num_blocks, block_size, latent + rope, generator=g)
    slots = _slots(num_tokens, num_blocks, block_size, g, skip=(3,))
    expected = kv_cache.clone()
    torch_ref.write_cache(expected, torch.cat([c_kv, k_pe], dim=-1), slots)

    write_mla_kv_cache(c_kv, k_pe, kv_cache, slots)
    assert torch.equal(kv_cache, expected)
