"""kernels_rocm.skinny_bmm (MLA's per-head absorption GEMVs) against torch.bmm in the interpreter,
on the operands MLAAttention.attend passes: q_nope a strided view of q [T, N, P + R], W_UV a
view of kv_b_proj's weight, W_UK^T the K-major copy process_weights_after_loading makes, the
attention output [T, N, L]; T 1, 3, 8, 1 and 8 heads, dims that no block divides; bf16 rounded
once; clear errors. ~10 s."""
from __future__ import annotations

import pytest
import torch

from kernels_rocm.skinny_gemm import MAX_M, GemvConfig, default_bmm_config, skinny_bmm
from model_ops.linear import dense_per_head

P, R, V, L = 20, 6, 12, 37  # qk_nope, rope, v_head, kv_lora: odd, short rows (tails, 4-byte vectors)


def _operands(t: int, heads: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, P + R, generator=g).to(dtype)
    kv_b = torch.randn(heads * (P + V), L, generator=g).to(dtype)
    w = kv_b.view(heads, P + V, L)
    w_uk, w_uv = w[:, :P], w[:, P:]
    out_latent = torch.randn(t, heads, L + 3, generator=g).to(dtype)[..., :L]  # padded rows: a strided view
    return q[..., :P], w_uk.transpose(1, 2).contiguous(), w_uk, w_uv, out_latent


def _bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference: what attend computed before (w [H, K, N])."""
    return torch.bmm(x.transpose(0, 1).float(), w.float()).transpose(0, 1)


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("heads", [1, 8])
@pytest.mark.parametrize("config", [None, GemvConfig(block_n=2, num_warps=1, vector_bytes=8),
                                    GemvConfig(block_n=8, num_warps=2, vector_bytes=4)],
                         ids=["default", "2x1w8B", "8x2w4B"])
def test_absorption_products_match_bmm(t, heads, config):
    q_nope, w_uk_t, w_uk, w_uv, out_latent = _operands(t, heads, torch.float32, seed=10 * t + heads)
    q_latent = skinny_bmm(q_nope, w_uk_t, config)
    assert q_latent.shape == (t, heads, L) and q_latent.is_contiguous()
    torch.testing.assert_close(q_latent, _bmm(q_nope, w_uk), atol=1e-4, rtol=1e-5)
    out = skinny_bmm(out_latent, w_uv, config)
    assert out.shape == (t, heads, V) and out.is_contiguous()
    torch.testing.assert_close(out, _bmm(out_latent, w_uv.transpose(1, 2)), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rounds_once(dtype):
    """fp32 accumulation, one rounding: within one ulp of the fp32 product rounded."""
    q_nope, w_uk_t, w_uk, w_uv, out_latent = _operands(3, 8, dtype, seed=5)
    for out, expected in ((skinny_bmm(q_nope, w_uk_t), _bmm(q_nope, w_uk)),
                          (skinny_bmm(out_latent, w_uv), _bmm(out_latent, w_uv.transpose(1, 2)))):
        assert out.dtype == dtype
        ulp = torch.finfo(dtype).eps * expected.abs().clamp_min(1.0)
        assert ((out.float() - expected).abs() <= ulp).all()


def test_dense_per_head_on_cpu_is_bmm():
    """The CPU path (and every path the kernel does not take) is torch.bmm itself, bit for bit."""
    q_nope, w_uk_t, w_uk, w_uv, _ = _operands(3, 8, torch.float32, seed=3)
    assert torch.equal(dense_per_head(q_nope, w_uk.transpose(1, 2)), torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1))
    assert torch.equal(dense_per_head(q_nope, w_uk_t), torch.bmm(q_nope.transpose(0, 1), w_uk_t.transpose(1, 2)).transpose(0, 1))


def test_default_config_fills_a_k_step_without_idle_lanes():
    """Kimi's rows: W_UV's 512 bf16 (1 KiB: 2 warps of 16-byte vectors), W_UK^T's 128 (256 bytes: one
    warp of 8-byte vectors)."""
    assert default_bmm_config(1, 8, 128, 512, 2, 132) == GemvConfig(block_n=4, num_warps=2, vector_bytes=16)
    assert default_bmm_config(4, 8, 512, 128, 2, 132) == GemvConfig(block_n=4, num_warps=1, vector_bytes=8)


def test_bad_input_errors():
    x, w = torch.randn(MAX_M + 1, 2, 16), torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="at most 8"):
        skinny_bmm(x, w)
    with pytest.raises(ValueError, match="batch dim"):
        skinny_bmm(torch.randn(2, 3, 16), w)
    with pytest.raises(ValueError, match="inner dim"):
        skinny_bmm(torch.randn(2, 2, 15), w)
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        skinny_bmm(torch.randn(2, 2, 16), torch.randn(2, 16, 5).transpose(1, 2))
    with pytest.raises(ValueError, match="vector_bytes"):
        skinny_bmm(torch.randn(2, 2, 16), w, GemvConfig(vector_bytes=2))
