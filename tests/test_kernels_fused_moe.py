"""kernels_rocm.fused_moe against the per-expert PyTorch loop."""
from __future__ import annotations

import pytest
import torch

from _kernel_cases import nan_like
from kernels_rocm import fused_moe as fused_moe_mod
from kernels_rocm.fused_moe import fused_moe, moe_align_block_size, moe_reference

HIDDEN, INTER, EXPERTS = 48, 40, 8  # not multiples of the 16/64 tiles: masks on N and K


def _routing(num_tokens, top_k, g, experts=EXPERTS, skip=(1, 5), hot=2):
    """Distinct experts per token; experts in `skip` get no tokens, `hot` is every token's first pick."""
    allowed = torch.tensor([e for e in range(experts) if e not in skip and e != hot])
    picks = torch.stack([allowed[torch.randperm(allowed.numel(), generator=g)[: top_k - 1]] for _ in range(num_tokens)])
    ids = torch.cat([torch.full((num_tokens, 1), hot), picks], dim=1)
    weights = torch.rand(num_tokens, top_k, generator=g)
    return weights / weights.sum(-1, keepdim=True), ids


def _weights(g, experts=EXPERTS, dtype=torch.float32):
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(experts, HIDDEN, INTER, generator=g) / INTER**0.5
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("num_tokens", [1, 5, 24, 200], ids=lambda t: f"T{t}")  # BLOCK_M 16, 16, 16, 64
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_matches_reference(num_tokens, ids_dtype):
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    w13, w2 = _weights(g)
    weights, ids = _routing(num_tokens, 3, g)
    out = fused_moe(x, w13, w2, weights, ids.to(ids_dtype), out=nan_like(x))
    torch.testing.assert_close(out, moe_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_block_m_32_and_top_1():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(100, HIDDEN, generator=g)
    w13, w2 = _weights(g)
    weights, ids = _routing(100, 3, g, skip=(1,))  # 300 pairs / 8 experts = 37.5 per expert: BLOCK_M 32
    out = fused_moe(x, w13, w2, weights, ids, out=nan_like(x))
    torch.testing.assert_close(out, moe_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    weights1, ids1 = weights[:, :1].contiguous(), ids[:, :1].contiguous()
    out1 = fused_moe(x, w13, w2, weights1, ids1)
    torch.testing.assert_close(out1, moe_reference(x, w13, w2, weights1, ids1), atol=1e-5, rtol=1e-5)


def test_bfloat16():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(12, HIDDEN, generator=g)
    w13, w2 = _weights(g)
    weights, ids = _routing(12, 2, g)
    expected = moe_reference(x, w13, w2, weights, ids)
    out = fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("num_tokens", [11, 700])  # 700 x 3 pairs: three chunks of ALIGN_CHUNK
@pytest.mark.parametrize("parallel", [False, True], ids=["one_program", "three_kernels"])
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_block_size_layout(block_m, parallel, num_tokens, monkeypatch):
    """Both forms of the alignment (one program; count, lay out and place over the GPU, taken from
    ALIGN_PARALLEL_PAIRS pairs) give a valid layout."""
    monkeypatch.setattr(fused_moe_mod, "ALIGN_PARALLEL_PAIRS", 0 if parallel else 10**9)
    g = torch.Generator().manual_seed(9)
    top_k = 3
    _, ids = _routing(num_tokens, top_k, g)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids.to(torch.int32), EXPERTS, block_m)
    numel = ids.numel()
    flat = ids.flatten()
    counts = torch.bincount(flat, minlength=EXPERTS)
    padded = (counts + block_m - 1) // block_m * block_m
    used = int(num_padded)
    assert used == int(padded.sum())
    assert sorted_ids.numel() >= used and sorted_ids.numel() % block_m == 0
    assert torch.equal(sorted_ids[used:], torch.full_like(sorted_ids[used:], numel))
    assert torch.all(expert_ids[used // block_m:] == -1)
    # Every pair appears once, in its expert's blocks; the rest of those blocks is sentinel.
    real = sorted_ids[:used]
    assert torch.equal(real[real < numel].sort().values, torch.arange(numel, dtype=torch.int32))
    block_expert = expert_ids[:used // block_m].repeat_interleave(block_m)
    assert torch.equal(flat[real[real < numel].long()], block_expert[real < numel].long())
    assert set(expert_ids[:used // block_m].tolist()) == set(torch.nonzero(counts).flatten().tolist())
