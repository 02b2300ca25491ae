"""GPU checks of the DeepSeek-V3 and Kimi-K2.5 (text) targets against transformers on the same
GPU (skipped without CUDA/ROCm). The checkpoints are saved in bf16, so fp32 runs of them are
exact references for the bf16 runs.

Tolerances, stated:
* fp32: logits within 2e-3 of the largest logit and the same 16 greedy tokens. (The CPU suite
  asserts 1e-4; the margin covers TF32-class dot products a Triton kernel may use for fp32.)
* bf16: per position, e = max |x - fp32| / max |fp32| over the vocabulary, against the fp32 run
  of the same checkpoint; the engine's median e is at most 1.25x (+1e-3) transformers' bf16
  median e, and its argmax agreement with fp32 at most 5 points below transformers' bf16 one.
  (Engine-vs-transformers bf16 is printed, not asserted: two bf16 MoE implementations flip
  near-tied router choices differently; measured on an H100 its p95 e was 0.28 while both
  engines' median e against fp32 were 2.3e-2.)
* bf16 greedy, 16 tokens for 16 prompts, batched: on average the engine follows the fp32 greedy
  path for at least (transformers bf16's average - 3) tokens. Exact token equality is not a
  bf16 criterion for a MoE: one rounding difference that flips a near-tied router choice
  changes every later token (the fp32 test above is the exact one).
Calibration on CPU: greedy prefixes following
fp32: engine 11.1 / transformers 11.3 (DeepSeek), 8.6 / 6.4 (Kimi) of 16. The backends in use
(torch reference or kernels_rocm's Triton MLA / fused MoE) are printed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_llama_parity import prefill_logits
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from atom_like import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")

# Kimi-like MLA ratios at 1/8 width (kv_lora_rank / rope = 8, heads share one latent row) with
# grouped routing, a dense first layer and YaRN with mscale_all_dim.
GPU_DEEPSEEK = dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                    num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16,
                    num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                    kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                    max_position_embeddings=1024)
MODELS = {"deepseek_v3": ("v3", {}), "kimi_k25": ("kimi", dict(n_group=1, topk_group=1, routed_scaling_factor=2.827))}
HORIZON = 16


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(0, 2048, int(rng.integers(8, 60)))] for _ in range(n)]


def checkpoint(make_deepseek, name: str) -> str:
    arch, overrides = MODELS[name]
    # std 0.05 keeps pre-activations near unit scale at width 512, so bf16 rarely flips routing
    return make_deepseek(arch, std=0.05, dtype=torch.bfloat16, **{**GPU_DEEPSEEK, **overrides})


def load_hf(path: str, name: str, dtype: torch.dtype):
    auto = AutoModelForImageTextToText if MODELS[name][0] == "kimi" else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=dtype).cuda().eval()


def load(make_deepseek, name: str, dtype: torch.dtype):
    path = checkpoint(make_deepseek, name)
    hf = load_hf(path, name, dtype)
    engine = LLMEngine(path, dtype=str(dtype).removeprefix("torch."), max_model_len=256,
                       gpu_memory_utilization=0.3, enforce_eager=True)
    layer = engine.runner.model.attention_layers()[0]
    experts = next(m for m in engine.runner.model.modules() if type(m).__name__ == "FusedExperts")
    print(f"{name} {dtype}: MLA backend {type(layer.backend).__name__}, experts {experts.impl.__module__}")
    return hf, engine


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt], device="cuda"), max_new_tokens=HORIZON,
                          min_new_tokens=HORIZON, do_sample=False)
    return out[0, len(prompt):].tolist()


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fp32_matches_transformers(make_deepseek, name):
    hf, engine = load(make_deepseek, name, torch.float32)
    batch = prompts(4)
    for prompt, logits in zip(batch, prefill_logits(engine, batch)):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt], device="cuda")).logits[0].float()
        assert float((logits - ref).abs().max() / ref.abs().max()) < 2e-3
    outs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=HORIZON, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(hf, prompt)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_parity_with_transformers(make_deepseek, name):
    hf, engine = load(make_deepseek, name, torch.bfloat16)
    hf32 = load_hf(checkpoint(make_deepseek, name), name, torch.float32)
    batch = prompts(8)
    pairs = ("engine~hf16", "engine~fp32", "hf16~fp32")
    errors, agree = {k: [] for k in pairs}, {k: [] for k in pairs}
    for prompt, logits in zip(batch, prefill_logits(engine, batch)):
        with torch.no_grad():
            ids = torch.tensor([prompt], device="cuda")
            ref, exact = hf(input_ids=ids).logits[0].float(), hf32(input_ids=ids).logits[0].float()
        for key, a, b in zip(pairs, (logits, logits, ref), (ref, exact, exact)):
            errors[key] += ((a - b).abs().amax(-1) / b.abs().amax(-1)).tolist()
            agree[key] += (a.argmax(-1) == b.argmax(-1)).tolist()
    p95 = float(np.percentile(errors["engine~hf16"], 95))
    median = {k: float(np.median(v)) for k, v in errors.items()}
    agreement = {k: float(np.mean(v)) for k, v in agree.items()}
    print(f"{name} bf16 prefill: vs transformers bf16 p95 relative logit error {p95:.2e} (max "
          f"{max(errors['engine~hf16']):.2e}), argmax agreement {agreement['engine~hf16']:.1%}; vs fp32 median "
          f"error engine {median['engine~fp32']:.2e} / transformers {median['hf16~fp32']:.2e}, argmax agreement "
          f"engine {agreement['engine~fp32']:.1%} / transformers {agreement['hf16~fp32']:.1%}")
    # Two bf16 MoE implementations flip routing near-ties differently, so they are compared with the
    # fp32 oracle rather than with each other (measured on an H100: engine-vs-transformers bf16 p95
    # 0.28, yet median error vs fp32 2.30e-2 vs transformers' 2.27e-2). Tolerance: the engine's
    # median error within 1.25x (+1e-3) of transformers' bf16, argmax agreement within 5 points.
    assert median["engine~fp32"] <= 1.25 * median["hf16~fp32"] + 1e-3
    assert agreement["engine~fp32"] >= agreement["hf16~fp32"] - 0.05

    # greedy: how long each bf16 path follows the fp32 one (tiny random MoEs are chaotic in bf16:
    # one flipped router choice changes every later token, for transformers as much as for us)
    batch = prompts(16, seed=1)
    outs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=HORIZON, ignore_eos=True), use_tqdm=False)
    ours, theirs, same = [], [], 0
    for prompt, out in zip(batch, outs):
        exact, ref = hf_greedy(hf32, prompt), hf_greedy(hf, prompt)
        ours.append(agreeing_prefix(out.token_ids, exact))
        theirs.append(agreeing_prefix(ref, exact))
        same += out.token_ids == ref
    print(f"{name} bf16 greedy over {HORIZON} tokens: follows fp32 for {np.mean(ours):.1f} tokens on average "
          f"(transformers bf16: {np.mean(theirs):.1f}); equal to transformers bf16 for {same}/{len(batch)} prompts")
    assert np.mean(ours) >= np.mean(theirs) - 3
