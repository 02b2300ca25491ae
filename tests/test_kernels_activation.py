"""kernels_rocm.activation.silu_and_mul against model_ops.activation's eager SwiGLU, and the
models on the kernel path (routed to CPU tensors here, under the interpreter) against eager."""
from __future__ import annotations

import pytest
import torch

from _kernel_cases import nan_like
from kernels_rocm.activation import BLOCK, silu_and_mul
from model_ops import activation


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [96, BLOCK + 76])  # one masked tile; a full tile and a masked one
def test_silu_and_mul(dtype, width):
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(5, 2 * width + 8, generator=g) * 4).to(dtype)[:, : 2 * width]  # odd rows, strided
    out = silu_and_mul(x, out=nan_like(x[:, :width].contiguous()))
    expected = activation.silu_and_mul(x)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    # silu(gate) is rounded to the activation dtype before the multiply, as eagerly: in half
    # precision all but a rare exp() ulp agree bit for bit (without that rounding ~1 in 4 differ)
    if dtype == torch.float16:
        assert (out != expected).float().mean() < 0.01


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="last dim must be even"):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="out shape"):
        silu_and_mul(torch.randn(2, 8), out=torch.empty(2, 8))


def test_models_on_the_fused_activation_path_generate_the_eager_tokens(make_llama, monkeypatch):
    from atom_like import LLMEngine, SamplingParams

    path = make_llama()
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    prompts = [[5, 9, 2, 7, 11], [3, 1, 4, 1, 5, 9, 2]]
    eager = LLMEngine(path, dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)

    calls = []
    kernel = activation.fused_kernels().silu_and_mul

    def counting(x):
        calls.append(x.shape)
        return kernel(x)

    monkeypatch.setattr(activation, "_kernel_for", lambda x: counting)
    fused = LLMEngine(path, dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)
    assert calls
    for a, b in zip(fused, eager):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close([t.logprob for t in a.logprobs], [t.logprob for t in b.logprobs], atol=1e-4, rtol=0)
