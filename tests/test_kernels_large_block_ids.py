"""Block ids past 65,535: the KV writes land exactly in the intended slots and attention reads them.

The pools hold 66,048 blocks (small rows keep them near 70 MB) and the block tables use only ids
>= 65,536, including the last block of the pool. Byte offsets past 4 GiB need GPU memory and are
covered in tests/gpu/test_kernels_gpu.py. Two batch layouts: decode + verify + prefill, and the
verify widths adaptive speculation allows (k up to 8: query lengths up to 9 per sequence; aiter's
MLA decode takes only 1, 2 or 4 query rows, kernels_rocm/aiter_ops.py: MLA_QUERY_LENS, so these
widths run on Triton on every backend).
"""
from __future__ import annotations

import pytest
import torch

from _kernel_cases import make_metadata, metadata_args, nan_like
from kernels_rocm.kv_cache import write_kv_cache, write_mla_kv_cache
from kernels_rocm.mla_decode import mla_paged_attention
from kernels_rocm.paged_attention import paged_attention
from model_ops.attention import torch_ref
from model_ops.quant.fp8 import dequantize_fp8, quantize_fp8

NUM_BLOCKS = 65_536 + 512
FIRST_HIGH_BLOCK = 65_536
BLOCK_SIZE = 16
LAYOUTS = {  # (query lengths, context lengths): contexts across block edges
    "decode-verify-prefill": ([1, 4, 33], [40, 100, 33]),
    "verify-up-to-k8": ([9, 6, 1, 5, 8], [40, 17, 33, 9, 70]),  # widths k + 1 for k = 8, 5, 4, 7 and a decode row
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def meta(request):
    q_lens, ctx_lens = LAYOUTS[request.param]
    meta = make_metadata(q_lens, ctx_lens, BLOCK_SIZE, NUM_BLOCKS, torch.Generator().manual_seed(0), FIRST_HIGH_BLOCK)
    assert meta.block_tables[0, 0] == NUM_BLOCKS - 1 and meta.max_query_len == max(q_lens)
    return meta


def _assert_written_exactly(cache, before, slots):
    """The slots whose rows differ from `before` are exactly the non-negative `slots`."""
    changed = (cache != before).flatten(2).any(-1).flatten().nonzero().squeeze(1)
    expected = slots[slots >= 0].sort().values
    assert expected.min() >= FIRST_HIGH_BLOCK * BLOCK_SIZE
    assert torch.equal(changed, expected)


def test_mha_write_then_attend(meta):
    g = torch.Generator().manual_seed(1)
    num_tokens, heads, dim = meta.slot_mapping.numel(), 1, 16
    # a guard block before each cache: a write to the skipped slot lands there, not outside the tensor
    pool = torch.randn(2, NUM_BLOCKS + 1, BLOCK_SIZE, heads, dim, generator=g)
    k_cache, v_cache = pool[:, 1:]
    guards = pool[:, 0].clone()
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(2, num_tokens, heads, dim, generator=g)
    slots = meta.slot_mapping.clone()
    slots[2] = -1  # a padding token: must not be written

    write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(pool[:, 0], guards), "the skipped slot was written"
    _assert_written_exactly(k_cache, k_before, slots)
    _assert_written_exactly(v_cache, v_before, slots)
    written = slots >= 0
    assert torch.equal(k_cache.flatten(0, 1)[slots[written]], key[written])
    assert torch.equal(v_cache.flatten(0, 1)[slots[written]], value[written])

    q = torch.randn(num_tokens, 3, dim, generator=g)  # GQA 3:1
    expected = torch_ref.paged_attention(q, k_cache, v_cache, meta, 0.25)
    for splits in (1, 4):
        out = paged_attention(q, k_cache, v_cache, *metadata_args(meta), 0.25, out=nan_like(q), num_kv_splits=splits)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_mla_write_then_attend(meta):
    g = torch.Generator().manual_seed(2)
    num_tokens, latent, rope, heads = meta.slot_mapping.numel(), 8, 8, 4
    kv_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, latent + rope, generator=g)
    before = kv_cache.clone()
    c_kv = torch.randn(num_tokens, latent, generator=g)
    k_pe = torch.randn(num_tokens, rope, generator=g)

    write_mla_kv_cache(c_kv, k_pe, kv_cache, meta.slot_mapping)
    _assert_written_exactly(kv_cache, before, meta.slot_mapping)
    assert torch.equal(kv_cache.flatten(0, 1)[meta.slot_mapping], torch.cat([c_kv, k_pe], dim=-1))

    q_latent = torch.randn(num_tokens, heads, latent, generator=g)
    q_pe = torch.randn(num_tokens, heads, rope, generator=g)
    expected = torch_ref.paged_attention(
        torch.cat([q_latent, q_pe], -1), kv_cache.unsqueeze(2), kv_cache[..., :latent].unsqueeze(2), meta, 0.2
    )
    for splits in (1, 4):
        out = mla_paged_attention(
            q_latent, q_pe, kv_cache, *metadata_args(meta), 0.2, out=nan_like(q_latent), num_kv_splits=splits
        )
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_fp8_write_then_attend(meta, kind):
    """The same with fp8 caches (1-byte elements: the block stride in bytes differs from the
    fp32 case above); e4m3fn for MHA, e4m3fnuz for MLA."""
    g = torch.Generator().manual_seed(3)
    num_tokens, dim = meta.slot_mapping.numel(), 16
    dtype = torch.float8_e4m3fn if kind == "mha" else torch.float8_e4m3fnuz
    scale = torch.tensor([0.75])
    shape = (NUM_BLOCKS, BLOCK_SIZE, 1, dim) if kind == "mha" else (NUM_BLOCKS, BLOCK_SIZE, dim)
    cache = quantize_fp8(torch.randn(*shape, generator=g), scale, dtype)
    before = cache.clone()
    rows = torch.randn(num_tokens, dim, generator=g)
    if kind == "mha":
        write_kv_cache(rows.unsqueeze(1), None, cache, None, meta.slot_mapping, k_scale=scale)
    else:
        write_mla_kv_cache(rows[:, :8], rows[:, 8:], cache, meta.slot_mapping, scale=scale)
    _assert_written_exactly(cache.view(torch.uint8), before.view(torch.uint8), meta.slot_mapping)
    written = cache.view(torch.uint8).flatten(0, 1)[meta.slot_mapping].reshape(num_tokens, dim)
    assert torch.equal(written, quantize_fp8(rows, scale, dtype).view(torch.uint8))

    values = dequantize_fp8(cache, scale)
    q = torch.randn(num_tokens, 4, dim, generator=g)
    for splits in (1, 4):
        if kind == "mha":
            expected = torch_ref.paged_attention(q, values, values, meta, 0.25)
            out = paged_attention(q, cache, cache, *metadata_args(meta), 0.25, k_scale=scale, v_scale=scale,
                                  out=nan_like(q), num_kv_splits=splits)
        else:
            expected = torch_ref.paged_attention(q, values.unsqueeze(2), values[..., :8].unsqueeze(2), meta, 0.25)
            out = mla_paged_attention(q[..., :8], q[..., 8:], cache, *metadata_args(meta), 0.25, kv_scale=scale,
                                      out=nan_like(q[..., :8]), num_kv_splits=splits)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
