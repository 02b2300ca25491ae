"""FP8 KV cache in the Triton kernels: writes bit for bit as model_ops.quant.fp8.quantize_fp8,
reads as dequantize_fp8, for OCP e4m3fn (CUDA, gfx950) and e4m3fnuz (gfx942).

Round trips: this step's rows are written by the kernel into caches already holding fp8 data,
then the attention kernels read them; the reference attends over the dequantized caches
(torch_ref, fp32), so both sides see the same fp8 rounding.
"""
from __future__ import annotations

import pytest
import torch

from _kernel_cases import BATCHES, make_metadata, metadata_args, nan_like
from kernels_rocm.kv_cache import write_kv_cache, write_mla_kv_cache
from kernels_rocm.mla_decode import mla_paged_attention
from kernels_rocm.paged_attention import paged_attention
from model_ops.attention import torch_ref
from model_ops.quant.fp8 import dequantize_fp8, fp8_max, quantize_fp8

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
IDS = ["e4m3fn", "e4m3fnuz"]
NUM_BLOCKS, BLOCK_SIZE = 64, 16


def _fp8_cache(shape, dtype, scale, g):
    """A cache already holding fp8 entries (earlier tokens), as the writes would have stored them."""
    return quantize_fp8(torch.randn(*shape, generator=g) * 2, scale, dtype)


def _rows(*shape, dtype, scale, g):
    """Rows to write: normal values, exact e4m3 ties (midpoints of two codes, times the scale),
    values past +-max (saturate), signed zeros."""
    rows = torch.randn(*shape, generator=g) * 3
    flat = rows.view(-1)
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    codes = codes[torch.isfinite(codes)].unique()
    ties = (codes[1:] + codes[:-1]) / 2
    n = min(ties.numel(), flat.numel() // 2)
    flat[:n] = ties[torch.randperm(ties.numel(), generator=g)[:n]] * scale
    flat[n: n + 4] = torch.tensor([1.5, -1.5, 1e4, -1e4]) * fp8_max(dtype) * scale
    flat[n + 4: n + 6] = torch.tensor([0.0, -0.0])
    return rows


def _write_reference(cache, rows, scale, slots):
    """torch_ref.write_cache of quantize_fp8(rows), through uint8 views (index_copy has no fp8 kernel on CPU)."""
    torch_ref.write_cache(cache.view(torch.uint8), quantize_fp8(rows, scale, cache.dtype).view(torch.uint8), slots)


def _same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("num_kv_splits", [1, 4], ids=["split1", "split4"])
def test_mha_write_then_attend(dtype, num_kv_splits):
    g = torch.Generator().manual_seed(0)
    q_lens, ctx_lens = BATCHES["decode"][0] + [2], BATCHES["decode"][1] + [40]  # decode + a verify row pair
    meta = make_metadata(q_lens, ctx_lens, BLOCK_SIZE, NUM_BLOCKS, g)
    k_scale, v_scale = torch.tensor([0.37]), torch.tensor([0.5])  # 0.5: the ties stay exact ties
    k_cache = _fp8_cache((NUM_BLOCKS, BLOCK_SIZE, 2, 32), dtype, k_scale, g)
    v_cache = _fp8_cache((NUM_BLOCKS, BLOCK_SIZE, 2, 32), dtype, v_scale, g)
    tokens = sum(q_lens)
    key = _rows(tokens, 2, 32, dtype=dtype, scale=k_scale, g=g)
    value = _rows(tokens, 2, 32, dtype=dtype, scale=v_scale, g=g)
    slots = meta.slot_mapping.clone()
    slots[1] = -1  # a padding token: not written
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    _write_reference(k_expected, key, k_scale, slots)
    _write_reference(v_expected, value, v_scale, slots)

    write_kv_cache(key, value, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    assert _same_bits(k_cache, k_expected) and _same_bits(v_cache, v_expected)

    q = torch.randn(tokens, 6, 32, generator=g)  # GQA 3:1
    out = paged_attention(q, k_cache, v_cache, *metadata_args(meta), 0.3, k_scale=k_scale, v_scale=v_scale,
                          out=nan_like(q), num_kv_splits=num_kv_splits)
    expected = torch_ref.paged_attention(q, dequantize_fp8(k_cache, k_scale), dequantize_fp8(v_cache, v_scale), meta, 0.3)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("num_kv_splits", [1, 4], ids=["split1", "split4"])
def test_mla_write_then_attend(dtype, num_kv_splits):
    g = torch.Generator().manual_seed(1)
    latent, rope, heads = 32, 16, 4
    q_lens, ctx_lens = BATCHES["verify_2"]
    meta = make_metadata(q_lens, ctx_lens, BLOCK_SIZE, NUM_BLOCKS, g)
    scale = torch.tensor([0.61])
    kv_cache = _fp8_cache((NUM_BLOCKS, BLOCK_SIZE, latent + rope), dtype, scale, g)
    tokens = sum(q_lens)
    c_kv = _rows(tokens, latent, dtype=dtype, scale=scale, g=g)
    k_pe = _rows(tokens, rope, dtype=dtype, scale=scale, g=g)
    expected_cache = kv_cache.clone()
    _write_reference(expected_cache, torch.cat([c_kv, k_pe], -1), scale, meta.slot_mapping)

    write_mla_kv_cache(c_kv, k_pe, kv_cache, meta.slot_mapping, scale=scale)
    assert _same_bits(kv_cache, expected_cache)

    q_latent = torch.randn(tokens, heads, latent, generator=g)
    q_pe = torch.randn(tokens, heads, rope, generator=g)
    out = mla_paged_attention(q_latent, q_pe, kv_cache, *metadata_args(meta), 0.2, kv_scale=scale,
                              out=nan_like(q_latent), num_kv_splits=num_kv_splits)
    rows = dequantize_fp8(kv_cache, scale)
    expected = torch_ref.paged_attention(torch.cat([q_latent, q_pe], -1), rows.unsqueeze(2),
                                         rows[..., :latent].unsqueeze(2), meta, 0.2)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_bfloat16_queries_on_fp8_cache():
    g = torch.Generator().manual_seed(2)
    q_lens, ctx_lens = BATCHES["mixed"]
    meta = make_metadata(q_lens, ctx_lens, BLOCK_SIZE, NUM_BLOCKS, g)
    scale = torch.tensor([0.5])
    kv_cache = _fp8_cache((NUM_BLOCKS, BLOCK_SIZE, 48), torch.float8_e4m3fn, scale, g)
    q = torch.randn(sum(q_lens), 4, 48, generator=g)
    out = mla_paged_attention(q[..., :32].bfloat16(), q[..., 32:].bfloat16(), kv_cache, *metadata_args(meta), 0.2,
                              kv_scale=scale)
    rows = dequantize_fp8(kv_cache, scale)
    expected = torch_ref.paged_attention(q, rows.unsqueeze(2), rows[..., :32].unsqueeze(2), meta, 0.2)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_fp8_scale_rules():
    """An fp8 cache without its scale, a scale for a non-fp8 cache, or a scale that is not a
    1-element fp32 tensor: ValueError naming the argument."""
    g = torch.Generator().manual_seed(3)
    meta = make_metadata([1], [5], BLOCK_SIZE, 8, g)
    fp8_cache = torch.zeros(8, BLOCK_SIZE, 2, 16, dtype=torch.float8_e4m3fn)
    cache = torch.zeros(8, BLOCK_SIZE, 2, 16)
    key, q, one = torch.randn(1, 2, 16), torch.randn(1, 2, 16), torch.tensor([1.0])
    slots = meta.slot_mapping
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache(key, key, fp8_cache, fp8_cache.clone(), slots)
    with pytest.raises(ValueError, match="v_scale"):
        write_kv_cache(key, key, fp8_cache, fp8_cache.clone(), slots, k_scale=one)
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache(key, key, cache, cache.clone(), slots, k_scale=one, v_scale=one)
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache(key, None, fp8_cache, None, slots, k_scale=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_cache(key, None, fp8_cache, None, slots, k_scale=1.0)
    with pytest.raises(ValueError, match="scale"):
        write_mla_kv_cache(torch.randn(1, 32), torch.randn(1, 16), torch.zeros(8, BLOCK_SIZE, 48), slots, scale=one)
    with pytest.raises(ValueError, match="v_scale"):
        paged_attention(q, fp8_cache, fp8_cache, *metadata_args(meta), 0.3, k_scale=one)
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention(q, cache, cache, *metadata_args(meta), 0.3, k_scale=one)
    with pytest.raises(ValueError, match="kv_scale"):
        mla_paged_attention(torch.randn(1, 2, 32), torch.randn(1, 2, 16),
                            torch.zeros(8, BLOCK_SIZE, 48, dtype=torch.float8_e4m3fnuz), *metadata_args(meta), 0.2)
    with pytest.raises(ValueError, match="kv_scale"):
        mla_paged_attention(torch.randn(1, 2, 32), torch.randn(1, 2, 16), torch.zeros(8, BLOCK_SIZE, 48),
                            *metadata_args(meta), 0.2, kv_scale=one.double())


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_mha_verify_rows_in_one_program(dtype):
    """A verify of 5 rows x group 4 in one 32-row program (12 sequences x 2 KV heads: past
    VERIFY_ONE_TILE_PROGRAMS_PER_CU on the interpreter's 4 units) reads fp8 as the 16-row tiles do."""
    g = torch.Generator().manual_seed(5)
    q_lens = [5, 1, 5, 3] * 3
    ctx_lens = [45, 17, 7, 70, 14, 5, 38, 3, 5, 1, 65, 21]
    meta = make_metadata(q_lens, ctx_lens, BLOCK_SIZE, NUM_BLOCKS, g)
    k_scale, v_scale = torch.tensor([0.37]), torch.tensor([0.5])
    k_cache = _fp8_cache((NUM_BLOCKS, BLOCK_SIZE, 2, 32), dtype, k_scale, g)
    v_cache = _fp8_cache((NUM_BLOCKS, BLOCK_SIZE, 2, 32), dtype, v_scale, g)
    q = torch.randn(sum(q_lens), 8, 32, generator=g)
    out = paged_attention(q, k_cache, v_cache, *metadata_args(meta), 0.3, k_scale=k_scale, v_scale=v_scale,
                          out=nan_like(q))
    expected = torch_ref.paged_attention(q, dequantize_fp8(k_cache, k_scale), dequantize_fp8(v_cache, v_scale), meta, 0.3)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
