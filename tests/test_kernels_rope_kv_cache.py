"""kernels_rocm.rope_kv_cache (rope fused with the KV write) against the eager path it replaces:
model_ops.rotary.RotaryEmbedding.apply on q and k, then torch_ref.write_cache.

Inputs are strided views of one projection row (as the models pass them), token counts are odd,
some slots are -1 (padding: nothing written, the query still rotated), head counts and rotary
dims are not powers of two, and caches sit between guard blocks (kv_cache tests' `guarded`)."""
from __future__ import annotations

import pytest
import torch
from test_kernels_fp8_kv import FP8, IDS, _fp8_cache, _rows, _same_bits, _write_reference
from test_kernels_kv_cache import _slots, assert_guards_untouched, guarded
from transformers import LlamaConfig

from kernels_rocm.rms_norm import rms_norm
from kernels_rocm.rope_kv_cache import rope_write_kv_cache, rope_write_mla_kv_cache
from model_ops.attention import torch_ref
from model_ops.rotary import RotaryEmbedding

NUM_BLOCKS, BLOCK_SIZE = 10, 8


def _rotary(rot: int, interleaved: bool) -> RotaryEmbedding:
    return RotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=2, rope_theta=500.0), rot, interleaved)


def _cos_sin(rotary: RotaryEmbedding, tokens: int, dtype, g) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 4000, (tokens,), generator=g)
    return rotary.cos_sin(positions, dtype)


def _qkv(tokens, q_heads, kv_heads, head_dim, dim_v, dtype, g):
    """q, k, v as views of one merged projection output (row stride = the whole row)."""
    sizes = [q_heads * head_dim, kv_heads * head_dim, kv_heads * dim_v]
    row = torch.randn(tokens, sum(sizes), generator=g).to(dtype)
    q, k, v = row.split(sizes, dim=-1)
    return q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, dim_v)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(6, 3, 48, 48), (4, 2, 32, 16)], ids=["gqa_odd_heads", "value_dim_differs"])
def test_rope_write_kv_cache(interleaved, dtype, shape):
    q_heads, kv_heads, head_dim, dim_v = shape
    g = torch.Generator().manual_seed(head_dim + interleaved)
    tokens = 9
    rotary = _rotary(head_dim, interleaved)
    cos, sin = _cos_sin(rotary, tokens, dtype, g)
    q, k, v = _qkv(tokens, q_heads, kv_heads, head_dim, dim_v, dtype, g)
    k_pool, k_cache = guarded(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=g, dtype=dtype)
    v_pool, v_cache = guarded(NUM_BLOCKS, BLOCK_SIZE, kv_heads, dim_v, generator=g, dtype=dtype)
    slots = _slots(tokens, NUM_BLOCKS, BLOCK_SIZE, g)
    k_before, v_before = k_pool.clone(), v_pool.clone()
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    torch_ref.write_cache(k_expected, rotary.apply(k, cos, sin), slots)
    torch_ref.write_cache(v_expected, v, slots)

    q_out = rope_write_kv_cache(q, k, v, k_cache, v_cache, cos, sin, slots, interleaved)
    assert torch.equal(q_out, rotary.apply(q, cos, sin))
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    assert_guards_untouched(k_pool, k_before)
    assert_guards_untouched(v_pool, v_before)


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_rope_write_fp8_cache(dtype):
    """fp8 caches store quantize_fp8(rope(k)) and quantize_fp8(v) bit for bit (ties, saturation, signed zeros)."""
    g = torch.Generator().manual_seed(5)
    tokens, kv_heads, head_dim = 7, 2, 32
    rotary = _rotary(head_dim, False)
    cos, sin = _cos_sin(rotary, tokens, torch.float32, g)
    k_scale, v_scale = torch.tensor([0.37]), torch.tensor([0.5])
    q = torch.randn(tokens, 4, head_dim, generator=g)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g) * 3
    k[0, 0, :2] = torch.tensor([1e4, -1e4])  # saturates after the rotation
    v = _rows(tokens, kv_heads, head_dim, dtype=dtype, scale=v_scale, g=g)
    k_cache = _fp8_cache((NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim), dtype, k_scale, g)
    v_cache = _fp8_cache((NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim), dtype, v_scale, g)
    slots = _slots(tokens, NUM_BLOCKS, BLOCK_SIZE, g, skip=(2,))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    _write_reference(k_expected, rotary.apply(k, cos, sin), k_scale, slots)
    _write_reference(v_expected, v, v_scale, slots)

    q_out = rope_write_kv_cache(q, k, v, k_cache, v_cache, cos, sin, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(q_out, rotary.apply(q, cos, sin))
    assert _same_bits(k_cache, k_expected) and _same_bits(v_cache, v_expected)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_rope_write_mla(interleaved):
    """The latent row [c_kv | rope(k_pe)] as DeepseekV2Attention forms it: q_pe a view of q_b's output,
    c_kv and k_pe views of kv_a's output."""
    g = torch.Generator().manual_seed(7)
    tokens, heads, nope, latent, rope = 11, 3, 16, 40, 24
    rotary = _rotary(rope, interleaved)
    cos, sin = _cos_sin(rotary, tokens, torch.float32, g)
    q = torch.randn(tokens, heads, nope + rope, generator=g)
    q_pe = q[..., nope:]
    c_kv, k_pe = torch.randn(tokens, latent + rope, generator=g).split([latent, rope], dim=-1)
    pool, kv_cache = guarded(NUM_BLOCKS, BLOCK_SIZE, latent + rope, generator=g)
    slots = _slots(tokens, NUM_BLOCKS, BLOCK_SIZE, g, skip=(3, 10))
    before, expected = pool.clone(), kv_cache.clone()
    k_rot = rotary.apply(k_pe.unsqueeze(1), cos, sin).squeeze(1)
    torch_ref.write_cache(expected, torch.cat([c_kv, k_rot], dim=-1), slots)

    q_out = rope_write_mla_kv_cache(q_pe, c_kv, k_pe, kv_cache, cos, sin, slots, interleaved)
    assert torch.equal(q_out, rotary.apply(q_pe, cos, sin))
    assert torch.equal(kv_cache, expected)
    assert_guards_untouched(pool, before)


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_rope_write_mla_fp8(dtype):
    g = torch.Generator().manual_seed(8)
    tokens, heads, latent, rope = 5, 2, 32, 16
    rotary = _rotary(rope, True)
    cos, sin = _cos_sin(rotary, tokens, torch.float32, g)
    scale = torch.tensor([0.61])
    q_pe = torch.randn(tokens, heads, rope, generator=g)
    c_kv = _rows(tokens, latent, dtype=dtype, scale=scale, g=g)
    k_pe = torch.randn(tokens, rope, generator=g) * 3
    kv_cache = _fp8_cache((NUM_BLOCKS, BLOCK_SIZE, latent + rope), dtype, scale, g)
    slots = _slots(tokens, NUM_BLOCKS, BLOCK_SIZE, g, skip=(1,))
    expected = kv_cache.clone()
    k_rot = rotary.apply(k_pe.unsqueeze(1), cos, sin).squeeze(1)
    _write_reference(expected, torch.cat([c_kv, k_rot], -1), scale, slots)

    rope_write_mla_kv_cache(q_pe, c_kv, k_pe, kv_cache, cos, sin, slots, scale=scale)
    assert _same_bits(kv_cache, expected)


@pytest.mark.parametrize("case", [(torch.bfloat16, None), (torch.float32, None), *((torch.bfloat16, d) for d in FP8)],
                         ids=["bf16", "fp32", *(f"bf16_{i}" for i in IDS)])
def test_rope_write_mla_fused_latent_norm(case):
    """The fused kv_a_layernorm: the row written is bit for bit the one kernels_rocm.rms_norm then the
    unfused write store (the norm's rounding to the activation dtype, then the cache's: fp8 quantizes
    the rounded norm). L 40 is no power of two (a masked norm); random weights; slots -1 skipped."""
    dtype, fp8 = case
    g = torch.Generator().manual_seed(12)
    tokens, heads, latent, rope, eps = 9, 3, 40, 16, 1e-5
    rotary = _rotary(rope, True)
    cos, sin = _cos_sin(rotary, tokens, dtype, g)
    q_pe = torch.randn(tokens, heads, rope, generator=g).to(dtype)
    c_kv, k_pe = (torch.randn(tokens, latent + rope, generator=g) * 3).to(dtype).split([latent, rope], dim=-1)
    weight = torch.randn(latent, generator=g).to(dtype)
    slots = _slots(tokens, NUM_BLOCKS, BLOCK_SIZE, g, skip=(2, 7))
    scale = torch.tensor([0.043]) if fp8 else None
    if fp8:
        pool = _fp8_cache((NUM_BLOCKS + 2, BLOCK_SIZE, latent + rope), fp8, scale, g)
    else:
        pool = torch.randn(NUM_BLOCKS + 2, BLOCK_SIZE, latent + rope, generator=g).to(dtype)
    kv_cache, before, expected = pool[1:-1], pool.clone(), pool.clone()[1:-1]

    q_expected = rope_write_mla_kv_cache(q_pe, rms_norm(c_kv, weight, eps), k_pe, expected, cos, sin, slots, scale=scale)
    q_out = rope_write_mla_kv_cache(q_pe, c_kv, k_pe, kv_cache, cos, sin, slots, scale=scale, norm_weight=weight,
                                    norm_eps=eps)
    assert torch.equal(q_out, q_expected)
    assert _same_bits(kv_cache, expected)
    assert_guards_untouched(pool.view(torch.uint8), before.view(torch.uint8))
    # the rows written hold the norm (to the fp8 step), not c_kv
    written = slots >= 0
    stored = kv_cache.flatten(0, 1)[slots[written], :latent].float() * (float(scale) if fp8 else 1.0)
    ref = torch.nn.functional.rms_norm(c_kv[written].float(), (latent,), weight.float(), eps)
    torch.testing.assert_close(stored, ref, atol=0.1 if fp8 else 0.05, rtol=0.07 if fp8 else 0.01)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "latent_norm"])
def test_rope_write_mla_rows_out_are_the_float_cache_rows(dtype, norm):
    """`rows_out` of a write into an fp8 cache holds, bit for bit, the rows the same kernel stores
    into a float cache (what MLA prefill over an fp8 cache attends for the step's own tokens), and
    the fp8 cache holds exactly their rounding; rows of slot -1 are left as they were."""
    g = torch.Generator().manual_seed(13)
    tokens, heads, latent, rope = 7, 3, 40, 16
    rotary = _rotary(rope, True)
    cos, sin = _cos_sin(rotary, tokens, dtype, g)
    q_pe = torch.randn(tokens, heads, rope, generator=g).to(dtype)
    c_kv, k_pe = (torch.randn(tokens, latent + rope, generator=g) * 3).to(dtype).split([latent, rope], dim=-1)
    extra = dict(norm_weight=torch.randn(latent, generator=g).to(dtype), norm_eps=1e-5) if norm else {}
    slots = _slots(tokens, NUM_BLOCKS, BLOCK_SIZE, g, skip=(4,))
    written = slots >= 0
    float_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, latent + rope, generator=g).to(dtype)
    rope_write_mla_kv_cache(q_pe, c_kv, k_pe, float_cache, cos, sin, slots, **extra)
    scale = torch.tensor([0.043])
    fp8_cache = _fp8_cache((NUM_BLOCKS, BLOCK_SIZE, latent + rope), FP8[0], scale, g)
    rows_out = torch.full((tokens, latent + rope), 7.0, dtype=dtype)
    rope_write_mla_kv_cache(q_pe, c_kv, k_pe, fp8_cache, cos, sin, slots, scale=scale, rows_out=rows_out, **extra)
    assert torch.equal(rows_out[written], float_cache.flatten(0, 1)[slots[written]])
    assert (rows_out[~written] == 7.0).all()
    expected = fp8_cache.clone()
    _write_reference(expected, rows_out, scale, slots)
    assert _same_bits(fp8_cache, expected)
    with pytest.raises(ValueError, match="rows_out has shape"):
        rope_write_mla_kv_cache(q_pe, c_kv, k_pe, fp8_cache, cos, sin, slots, scale=scale, rows_out=rows_out[:, 1:])


def test_padding_rows_write_nothing_but_rotate_q():
    g = torch.Generator().manual_seed(9)
    rotary = _rotary(16, False)
    cos, sin = _cos_sin(rotary, 3, torch.float32, g)
    slots = torch.full((3,), -1, dtype=torch.int64)
    q, k, v = _qkv(3, 2, 1, 16, 16, torch.float32, g)
    k_pool, k_cache = guarded(4, 8, 1, 16, generator=g)
    v_pool, v_cache = guarded(4, 8, 1, 16, generator=g)
    k_before, v_before = k_pool.clone(), v_pool.clone()
    q_out = rope_write_kv_cache(q, k, v, k_cache, v_cache, cos, sin, slots)
    assert torch.equal(k_pool, k_before) and torch.equal(v_pool, v_before)
    assert torch.equal(q_out, rotary.apply(q, cos, sin))


def test_rejects_bad_inputs():
    g = torch.Generator().manual_seed(10)
    rotary = _rotary(16, False)
    cos, sin = _cos_sin(rotary, 3, torch.float32, g)
    q, k, v = _qkv(3, 2, 1, 16, 16, torch.float32, g)
    k_cache, v_cache = torch.randn(4, 8, 1, 16), torch.randn(4, 8, 1, 16)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="cos has shape"):
        rope_write_kv_cache(q, k, v, k_cache, v_cache, cos[:, :4], sin, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_write_kv_cache(q, k, v, k_cache, v_cache, cos, sin, slots[:2])
    with pytest.raises(ValueError, match="k_scale"):
        rope_write_kv_cache(q, k, v, k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn), cos, sin, slots)
    with pytest.raises(ValueError, match="kv_cache has shape"):
        rope_write_mla_kv_cache(q, torch.randn(3, 8), k[:, 0], torch.randn(4, 8, 20), cos, sin, slots)
