"""GPU checks of MXFP4 models and the fp8 KV cache on tiny-kimi-mxfp4 (built into the zoo cache
on first use; skipped without CUDA/ROCm): the Triton MXFP4 kernels against the PyTorch
dequantize reference inside the engine, fp8 KV through the Triton attention kernels against the
torch reference backend, and CUDA graphs (target step and draft loop) over both, token for token
against eager.

The MXFP4 kernels are checked against the reference run in fp32 (see the first test for why
not bf16 against bf16); fp8 KV in fp32: Triton and torch attention differ only in accumulation
order, so their logits must stay within 2% of the logit range and pick the same argmax at >= 97%
of positions.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from atom_like import LLMEngine, SamplingParams
from atom_like.zoo import resolve

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
KERNELS = all(importlib.util.find_spec(m) is not None for m in ("kernels_rocm.mxfp4_moe", "kernels_rocm.mxfp4_linear"))
KW = dict(dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3, max_num_seqs=16)


def batch(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1] + [int(x) for x in rng.integers(20, 8000, int(rng.integers(16, 120)))] for _ in range(n)]


def relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    err = max(float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(a, b))
    agree = sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b)) / sum(len(y) for y in b)
    return err, agree


def compare(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    err, agree = relative_error(a, b)
    print(f"{what}: relative logit error {err:.2e}, argmax agreement {agree:.1%}")
    assert err < 2e-2 and agree >= 0.97, what


@pytest.fixture(scope="module")
def model() -> str:
    return str(resolve("tiny-kimi-mxfp4"))


@pytest.mark.skipif(not KERNELS, reason="kernels_rocm has no MXFP4 kernels here")
def test_mxfp4_kernels_match_the_reference_in_the_engine(model, monkeypatch):
    """Against the PyTorch dequantize reference run in fp32 (the oracle): the kernels in fp32 agree
    with it to rounding, and in bf16 they are no further from it than the reference in bf16 is.
    Kernel bf16 vs reference bf16 directly is no test here: with MXFP4 activations a 1-ulp bf16
    difference flips an E2M1 code, and on H100 the two bf16 paths disagree on 16% of this tiny
    model's argmaxes while each is as far from fp32 as the other (2026-11-22 run)."""
    from test_llama_parity import prefill_logits

    from model_ops.quant import mxfp4_layers

    prompts = batch()
    kw = {k: v for k, v in KW.items() if k != "dtype"}
    for activations in ("checkpoint", "unquantized"):
        kernels = {dtype: prefill_logits(LLMEngine(model, enforce_eager=True, dtype=dtype, mxfp4_activations=activations,
                                                   **kw), prompts) for dtype in ("float32", "bfloat16")}
        with monkeypatch.context() as mp:
            mp.setattr(mxfp4_layers, "select_mxfp4_linear_impl", lambda device: mxfp4_layers.mxfp4_linear_reference)
            reference = {dtype: prefill_logits(LLMEngine(model, enforce_eager=True, dtype=dtype, moe_backend="torch",
                                                         mxfp4_activations=activations, **kw), prompts)
                         for dtype in ("float32", "bfloat16")}
        fp32_err, fp32_agree = relative_error(kernels["float32"], reference["float32"])
        kernel_err, _ = relative_error(kernels["bfloat16"], reference["float32"])
        reference_err, _ = relative_error(reference["bfloat16"], reference["float32"])
        print(f"{activations} activations: kernels fp32 vs reference fp32 {fp32_err:.2e} ({fp32_agree:.1%} argmax); "
              f"bf16 vs the fp32 reference: kernels {kernel_err:.3e}, reference {reference_err:.3e}")
        assert fp32_err < 1e-4 and fp32_agree == 1.0, activations
        assert kernel_err <= 1.25 * reference_err, activations


def test_fp8_kv_triton_matches_the_torch_backend(model):
    """In fp32: in bf16 the Triton backend's fused rope + KV write rounds once where the torch
    backend's eager rope rounds twice, and this W4A4 model turns such 1-ulp differences into
    argmax flips (see the first test)."""
    from test_llama_parity import prefill_logits

    prompts = batch(seed=1)
    kw = dict(KW, dtype="float32")
    got = prefill_logits(LLMEngine(model, enforce_eager=True, kv_cache_dtype="fp8", attention_backend="triton", **kw),
                         prompts)
    expected = prefill_logits(LLMEngine(model, enforce_eager=True, kv_cache_dtype="fp8", attention_backend="torch",
                                        **kw), prompts)
    compare(got, expected, "fp8 KV: Triton attention vs torch reference")


@pytest.mark.skipif(not KERNELS, reason="the MXFP4 reference reads routing on the host: no graphs without kernels")
@pytest.mark.parametrize("draft", ["tiny-kimi-eagle3", "tiny-kimi-eagle3-mla"])
def test_graphs_replay_eager_with_fp8_kv_and_a_draft(model, draft):
    """Scales are device tensors bound once: the captured target step and draft loop see them.
    In fp32: in bf16 this W4A4 model flips argmaxes on 1-ulp differences (see above), and graph
    replay is not bit-identical to eager for the MXFP4 kernels in bf16 (H100, 2026-11-22: the
    first token differs at steps 2-8; cause not yet found, see docs/benchmarks.md §6)."""
    kw = dict(KW, dtype="float32", kv_cache_dtype="fp8", method="eagle3", draft_model=str(resolve(draft)), num_speculative_tokens=3,
              speculative_adaptive=False)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = batch(4, seed=2)
    eager = LLMEngine(model, enforce_eager=True, **kw)
    expected = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    graphed = LLMEngine(model, **kw)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.first_pass[1, 4].graph is not None
    assert [o.token_ids for o in graphed.generate(prompts, params, use_tqdm=False)] == expected
    assert graphed.runner.kv_caches["eagle3_kv_cache"].dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
