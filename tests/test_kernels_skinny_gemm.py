"""kernels_rocm.skinny_gemm (GEMV-style, M <= 8) against F.linear in the interpreter: odd N and K
that no block divides (the masked K tail, the clamped last rows), strided rows of x and w,
M = 1, 3, 8 (padded to a power of two), several launch configs, fp16/bf16 rounding once, and
clear errors for bad inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels_rocm.activation import silu_and_mul
from kernels_rocm.rms_norm import rms_norm
from kernels_rocm.skinny_gemm import MAX_M, GemvConfig, default_config, skinny_gemm

# 16 rows of 16-byte vectors are past PRELOAD_BYTES: the first step is loaded after the PDL wait there
CONFIGS = [GemvConfig(block_n=4, num_warps=1), GemvConfig(block_n=8, num_warps=2), GemvConfig(block_n=16, num_warps=1),
           None]


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("config", CONFIGS, ids=["4x1", "8x2", "16x1_no_preload", "default"])
def test_matches_linear(m, config):
    g = torch.Generator().manual_seed(m)
    # fp32: 16-byte vectors of 4, 1 warp: K steps of 128. K 389 = 3 steps + a tail of 5 (one vector
    # cut short); N 37 leaves the last block of rows partly past N.
    n, k = 37, 389
    x = torch.randn(m, k + 3, generator=g)[:, :k]
    w = torch.randn(n, k + 7, generator=g)[:, :k]
    out = skinny_gemm(x, w, config)
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_k_within_one_step_and_n_below_block():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 6, generator=g), torch.randn(3, 6, generator=g)
    torch.testing.assert_close(skinny_gemm(x, w, GemvConfig(block_n=8, num_warps=1)), F.linear(x, w),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rounds_once(dtype):
    """fp32 accumulation, one rounding to x's dtype: within one ulp of the fp32 product rounded
    (summation order; and the interpreter truncates to bf16 where compiled Triton rounds)."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 264, generator=g).to(dtype), torch.randn(40, 264, generator=g).to(dtype)
    out = skinny_gemm(x, w, GemvConfig(block_n=8, num_warps=1))
    assert out.dtype == dtype
    expected = F.linear(x.float(), w.float())
    ulp = torch.finfo(dtype).eps * expected.abs().clamp_min(1.0)
    assert ((out.float() - expected).abs() <= ulp).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("config", [GemvConfig(block_n=2, num_warps=1), GemvConfig(block_n=8, num_warps=2)],
                         ids=["2x1", "8x2"])
def test_swiglu_epilogue_equals_gemm_then_silu_and_mul(dtype, m, config):
    """The fused epilogue is bit-identical to the GEMM's rounded output followed by the SiLU-and-mul
    kernel (each output's dot products run the same lanes in the same order), and close to the
    eager SwiGLU. I = 19 leaves the last program's outputs partly past I."""
    g = torch.Generator().manual_seed(7 + m)
    inter, k = 19, 389
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(2 * inter, k + 5, generator=g).to(dtype)[:, :k]
    fused = skinny_gemm(x, w, config, swiglu=True)
    assert fused.shape == (m, inter) and fused.dtype == dtype
    assert torch.equal(fused, silu_and_mul(skinny_gemm(x, w, config)))
    gate, up = F.linear(x.float(), w.float()).chunk(2, dim=-1)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused.float(), F.silu(gate) * up, atol=tol, rtol=tol)


@pytest.mark.parametrize("m", [1, 4])
def test_fp32_output_of_bf16_operands(m):
    """out_dtype fp32 (the router's logits): the sums unrounded, i.e. F.linear(x.float(), w.float()) up to
    summation order, where a bf16 output would be off by up to half a bf16 ulp. block_n 1: one row a program."""
    g = torch.Generator().manual_seed(11 + m)
    x, w = torch.randn(m, 389, generator=g).bfloat16(), torch.randn(37, 389, generator=g).bfloat16()
    out = skinny_gemm(x, w, GemvConfig(block_n=1, num_warps=1), out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.float(), w.float()), atol=1e-4, rtol=1e-5)
    assert not torch.equal(out, out.bfloat16().float())  # really unrounded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("config", [GemvConfig(block_n=4, num_warps=1), GemvConfig(block_n=8, num_warps=2)],
                         ids=["4x1", "8x2"])
def test_rms_norm_prologue_equals_rms_norm_then_gemm(dtype, m, config):
    """norm_weight: the product of kernels_rocm.rms_norm(x) and w. The normalized x can differ from the
    norm kernel's only through the sum of squares' order (a last-bit difference of the fp32 rstd), so
    fp32 is equal to tolerance and bf16 within one ulp of the unfused result. x rows are strided views
    at very different scales (the norm matters); K 389 leaves a masked tail."""
    g = torch.Generator().manual_seed(21 + m)
    n, k, eps = 37, 389, 1e-5
    x = (torch.randn(m, k + 4, generator=g) * torch.logspace(-2, 2, m).unsqueeze(1)).to(dtype)[:, :k]
    w = torch.randn(n, k, generator=g).to(dtype)
    weight = (1 + torch.randn(k, generator=g) * 0.3).to(dtype)
    fused = skinny_gemm(x, w, config, norm_weight=weight, norm_eps=eps)
    unfused = skinny_gemm(rms_norm(x, weight, eps), w, config)
    assert fused.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(fused, unfused, atol=1e-4, rtol=1e-5)
    else:
        ulp = torch.finfo(dtype).eps * unfused.float().abs().clamp_min(1.0)
        assert ((fused.float() - unfused.float()).abs() <= ulp).all()
    expected = F.linear(F.rms_norm(x.float(), (k,), weight.float(), eps), w.float())
    torch.testing.assert_close(fused.float(), expected, atol=0.3 if dtype == torch.bfloat16 else 1e-4, rtol=2e-2)


def test_empty_shapes():
    x = torch.randn(2, 0)
    assert torch.equal(skinny_gemm(x, torch.randn(5, 0)), torch.zeros(2, 5))
    assert skinny_gemm(torch.randn(0, 8), torch.randn(5, 8)).shape == (0, 5)


def test_default_config_is_the_measured_one():
    assert [default_config(m) for m in (1, 2, 3, 8)] == [GemvConfig(4, 8), GemvConfig(4, 8), GemvConfig(4, 2), GemvConfig(4, 2)]


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="w has shape .*x's inner dim"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 6))
    with pytest.raises(ValueError, match=f"x has {MAX_M + 1} rows.*at most {MAX_M}"):
        skinny_gemm(torch.randn(MAX_M + 1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="w must have dtype"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 8).half())
    with pytest.raises(ValueError, match="x must have dtype"):
        skinny_gemm(torch.ones(2, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must have 2 dims"):
        skinny_gemm(torch.randn(1, 2, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="w must be contiguous in its last dim"):
        skinny_gemm(torch.randn(2, 8), torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="w on meta"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 8, device="meta"))
    with pytest.raises(ValueError, match="block_n must be a power of two, got 6"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 8), GemvConfig(block_n=6))
    with pytest.raises(ValueError, match="out_dtype torch.float16: skinny_gemm writes"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 8), out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out_dtype torch.float32: skinny_gemm writes"):
        skinny_gemm(torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16(), swiglu=True, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"swiglu needs an even row count"):
        skinny_gemm(torch.randn(2, 8), torch.randn(5, 8), swiglu=True)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 2 with swiglu, got 1"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 8), GemvConfig(block_n=1), swiglu=True)
    with pytest.raises(ValueError, match="norm_weight has shape .*x's inner dim"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 8), norm_weight=torch.ones(6))
    with pytest.raises(ValueError, match="num_warps must be one of .* got 3"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 8), GemvConfig(num_warps=3))
