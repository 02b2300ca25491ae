"""DeepSeek-V2/V3 and Kimi-K2.5 (text) against transformers' own models (fp32, CPU): logits of
batched prompts through the paged MLA cache, and greedy generation, where decode steps in the
absorbed MLA form read latent rows that prefill steps wrote in the expanded form."""
from __future__ import annotations

import pytest
import torch
from test_llama_parity import PROMPTS, prefill_logits
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from atom_like import LLMEngine, SamplingParams

# (arch, text-config overrides); the base config (conftest.TINY_DEEPSEEK) has groups with
# topk_group < n_group, a q LoRA, YaRN with mscale/mscale_all_dim, one dense layer and
# norm_topk_prob true; a random correction bias is always set. One variant uses the neox RoPE
# layout (rope_interleave false), the others DeepSeek's interleaved one.
VARIANTS = {
    "v3_groups_yarn": ("v3", {}),
    "v3_no_q_lora_unnormed_neox": ("v3", dict(q_lora_rank=None, norm_topk_prob=False, first_k_dense_replace=2,
                                              num_hidden_layers=4, n_group=1, topk_group=1, rope_interleave=False,
                                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # transformers' only DeepSeek router with softmax scores is V2's (greedy / group_limited_greedy)
    "v2_softmax_grouped": ("v2", dict(q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
    "kimi_k25": ("kimi", dict(n_group=1, topk_group=1, routed_scaling_factor=2.827)),
}


def load_hf(path: str, arch: str):
    auto = AutoModelForImageTextToText if arch == "kimi" else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([prompt])).logits[0]


def assert_close_rel(logits: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    rel = (logits - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"{what}: relative error {rel:.2e}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_match_transformers(make_deepseek, variant):
    arch, overrides = VARIANTS[variant]
    path = make_deepseek(arch, **overrides)
    hf = load_hf(path, arch)
    # 48 tokens per step: the 77-token prompt is prefilled in chunks over its cached prefix, and
    # some decodes share a step with a prefill chunk (both then take the expanded form)
    engine = LLMEngine(path, max_model_len=256, max_num_batched_tokens=48)

    for prompt, logits in zip(PROMPTS, prefill_logits(engine, PROMPTS)):
        assert_close_rel(logits, hf_logits(hf, prompt), f"{variant}, prompt of {len(prompt)} tokens")

    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):]
        assert out.token_ids == ref.tolist(), f"{variant}: prompt of {len(prompt)} tokens diverged"


def test_either_mla_form_matches_transformers(make_deepseek, monkeypatch):
    """Long prompts in the absorbed form, single tokens in the expanded form: both are exact."""
    path = make_deepseek("v3")
    hf = load_hf(path, "v3")
    refs = [hf_logits(hf, prompt) for prompt in PROMPTS]
    engine = LLMEngine(path, max_model_len=256)
    for threshold, form in ((0, "expanded"), (10**6, "absorbed")):
        monkeypatch.setattr("model_ops.attention.mla.ABSORBED_MAX_QUERY_LEN", threshold)
        for prompt, logits, ref in zip(PROMPTS, prefill_logits(engine, PROMPTS), refs):
            assert_close_rel(logits, ref, f"all {form}, prompt of {len(prompt)} tokens")
