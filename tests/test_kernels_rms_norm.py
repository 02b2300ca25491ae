"""kernels_rocm.rms_norm against the HF-style eager RMSNorm."""
from __future__ import annotations

import pytest
import torch

from _kernel_cases import nan_like
from kernels_rocm.rms_norm import fused_add_rms_norm, rms_norm, rms_norm_reference

EPS = 1e-6


@pytest.mark.parametrize("hidden", [64, 200])  # 200: masked tail of a 256-wide row
def test_rms_norm(hidden):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden + 8, generator=g)[:, :hidden]  # strided rows
    weight = torch.randn(hidden, generator=g)
    out = rms_norm(x, weight, EPS, out=nan_like(x.contiguous()))
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=g).to(dtype)
    residual = torch.randn(6, 96, generator=g).to(dtype)
    weight = torch.randn(96, generator=g).to(dtype)
    expected_residual = x + residual
    expected = rms_norm_reference(expected_residual, weight, EPS)

    out, new_residual = fused_add_rms_norm(x, residual, weight, EPS, out=nan_like(x))
    assert new_residual is residual
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_rejects_bad_inputs():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.randn(8), EPS)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.randn(2, 8), torch.randn(16), EPS)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.randn(2, 16).half(), torch.randn(16), EPS)


def test_models_on_the_fused_norm_path_generate_the_eager_tokens(make_llama, monkeypatch):
    """model_ops.layernorm sends GPU tensors to these kernels (the residual add written in place);
    routed here for CPU tensors under the interpreter, a Llama stack's logprobs and greedy tokens
    equal the eager path's."""
    from atom_like import LLMEngine, SamplingParams
    from model_ops import layernorm

    path = make_llama()
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    prompts = [[5, 9, 2, 7, 11], [3, 1, 4, 1, 5, 9, 2]]
    eager = LLMEngine(path, dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)

    calls = {"rms_norm": 0, "fused_add_rms_norm": 0}
    kernels = layernorm.fused_kernels()

    class Counting:
        def __getattr__(self, name):
            calls[name] += 1
            return getattr(kernels, name)

    monkeypatch.setattr(layernorm, "_kernels_for", lambda x: Counting())
    fused = LLMEngine(path, dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)
    assert calls["rms_norm"] > 0 and calls["fused_add_rms_norm"] > 0
    for a, b in zip(fused, eager):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close([t.logprob for t in a.logprobs], [t.logprob for t in b.logprobs], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eager_norm_rounds_like_transformers(dtype):
    """The eager RMSNorm (the CPU path) and rms_norm_reference (the GPU kernel's oracle) equal
    transformers' LlamaRMSNorm bit for bit in half precision: the normalised row is rounded to the
    activation dtype before the weight multiply. A weight applied in fp32 instead changes about a
    quarter of bf16 outputs by one ulp, which no fp32 CPU test can see."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from model_ops.layernorm import RMSNorm

    g = torch.Generator().manual_seed(4)
    x, residual = (torch.randn(2, 16, 512, generator=g) * 3).to(dtype)
    weight = (1 + 0.5 * torch.randn(512, generator=g)).to(dtype)
    hf = LlamaRMSNorm(512, eps=EPS).to(dtype)
    ours = RMSNorm(512, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
        ours.weight.copy_(weight)
        expected = hf(x)
        assert torch.equal(ours(x), expected)
        assert torch.equal(rms_norm_reference(x, weight, EPS), expected)
        out, new_residual = ours.add_forward(x, residual)
        assert torch.equal(new_residual, x + residual) and torch.equal(out, hf(x + residual))
