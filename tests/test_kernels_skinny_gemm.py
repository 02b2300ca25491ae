"""kernels_rocm.skinny_gemm (split-K, atomics) against F.linear: odd M, N and K that no block
divides, strided rows, several K splits (partials added into one output)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels_rocm.skinny_gemm import MAX_M, skinny_gemm


@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("split_k", [None, 3])
def test_skinny_gemm_matches_linear(m, split_k):
    g = torch.Generator().manual_seed(m)
    n, k = 72, 200  # 2 N blocks (the 2nd masked), K blocks of 32: 7, the last masked
    x = torch.randn(m, k + 8, generator=g)[:, :k]
    w = torch.randn(n, k, generator=g)
    out = skinny_gemm(x, w, block_n=64, block_k=32, split_k=split_k)
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_half_precision_rounds_once():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 96, generator=g).half(), torch.randn(40, 96, generator=g).half()
    out = skinny_gemm(x, w, block_n=32, block_k=32, split_k=2)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, F.linear(x.float(), w.float()).half(), atol=2e-2, rtol=1e-3)


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="inner dim"):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 6))
    with pytest.raises(ValueError, match=f"at most {MAX_M}"):
        skinny_gemm(torch.randn(MAX_M + 1, 8), torch.randn(4, 8))
