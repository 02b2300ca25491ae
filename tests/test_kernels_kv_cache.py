"""kernels_rocm.kv_cache writes against torch_ref.write_cache.

Every cache here is a view into a pool with a guard block on each side (`guarded`): a kernel that
writes a skipped slot (-1) or past the last block hits a guard, which the test asserts untouched,
instead of corrupting memory it does not own (which aborts or hangs the whole run)."""
from __future__ import annotations

import pytest
import torch

from kernels_rocm.kv_cache import write_kv_cache, write_mla_kv_cache
from model_ops.attention import torch_ref


def guarded(num_blocks: int, *row: int, generator: torch.Generator, dtype=torch.float32):
    """(pool, cache): random cache [num_blocks, *row] = pool[1:-1]."""
    pool = torch.randn(num_blocks + 2, *row, generator=generator).to(dtype)
    return pool, pool[1:-1]


def assert_guards_untouched(pool: torch.Tensor, before: torch.Tensor) -> None:
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[-1], before[-1]), "a write landed outside the cache"


def _slots(num_tokens, num_blocks, block_size, g, skip=(1, 4)):
    """Distinct random slots, the cache's last one first, with -1 (skip) at the `skip` token indices."""
    slots = torch.randperm(num_blocks * block_size - 1, generator=g)[:num_tokens]
    slots[0] = num_blocks * block_size - 1
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
    k_pool, k_cache = guarded(num_blocks, block_size, heads, dim_k, generator=g)
    v_pool, v_cache = guarded(num_blocks, block_size, heads, dim_v, generator=g)
    slots = _slots(num_tokens, num_blocks, block_size, g)
    k_before, v_before = k_pool.clone(), v_pool.clone()
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    torch_ref.write_cache(k_expected, key, slots)
    torch_ref.write_cache(v_expected, value, slots)

    write_kv_cache(key, value, k_cache, v_cache, slots)
    assert_guards_untouched(k_pool, k_before)
    assert_guards_untouched(v_pool, v_before)
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


def test_write_key_only_into_pool_view_with_cast():
    # bf16 cache that is one layer of a [2, layers, NB, BS, H, D] pool; fp32 keys are cast on store
    # (the interpreter truncates to bf16 where torch and compiled Triton round: allow one ulp).
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(2, 3, 10, 16, 2, 32, generator=g).to(torch.bfloat16)
    k_cache = pool[0, 2]
    key = torch.randn(7, 2, 32, generator=g)
    slots = _slots(7, 10, 16, g, skip=(0,))  # a stray write lands in layer 1's V rows: still inside the pool
    expected = pool.clone()
    torch_ref.write_cache(expected[0, 2], key, slots)

    write_kv_cache(key, None, k_cache, None, slots)
    torch.testing.assert_close(pool, expected, atol=0, rtol=2**-7)


def test_write_mla_kv_cache():
    g = torch.Generator().manual_seed(2)
    num_blocks, block_size, latent, rope, num_tokens = 10, 16, 40, 24, 11
    c_kv = torch.randn(num_tokens, latent + 8, generator=g)[:, :latent]  # strided rows
    k_pe = torch.randn(num_tokens, rope, generator=g)
    pool, kv_cache = guarded(num_blocks, block_size, latent + rope, generator=g)
    slots = _slots(num_tokens, num_blocks, block_size, g, skip=(3,))
    before, expected = pool.clone(), kv_cache.clone()
    torch_ref.write_cache(expected, torch.cat([c_kv, k_pe], dim=-1), slots)

    write_mla_kv_cache(c_kv, k_pe, kv_cache, slots)
    assert_guards_untouched(pool, before)
    assert torch.equal(kv_cache, expected)



@pytest.mark.timeout(300)
def test_a_batch_of_padding_writes_nothing():
    """A captured batch's padded rows: every slot -1, MHA and MLA; caches unchanged, guards too."""
    g = torch.Generator().manual_seed(3)
    slots = torch.full((5,), -1, dtype=torch.int64)
    k_pool, k_cache = guarded(4, 8, 2, 16, generator=g)
    mla_pool, mla_cache = guarded(4, 8, 24, generator=g)
    k_before, mla_before = k_pool.clone(), mla_pool.clone()
    write_kv_cache(torch.randn(5, 2, 16, generator=g), None, k_cache, None, slots)
    write_mla_kv_cache(torch.randn(5, 16, generator=g), torch.randn(5, 8, generator=g), mla_cache, slots)
    assert torch.equal(k_pool, k_before) and torch.equal(mla_pool, mla_before)
