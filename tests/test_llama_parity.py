"""The engine against transformers' own Llama: logits and greedy generation (fp32, CPU)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from atom_like import LLMEngine, SamplingParams
from atom_like.engine.step_inputs import host_step, upload

PROMPTS = [[3, 17, 42], list(range(5, 45)), [7], [int(x) for x in np.random.default_rng(0).integers(0, 128, 77)]]

VARIANTS = {
    "gqa_untied": {},
    "mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32}),
    "bias_headdim": dict(attention_bias=True, head_dim=32),
}


def prefill_logits(engine: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits at every prompt position, all prompts in one batch, through the paged cache."""
    runner, bs = engine.runner, engine.args.block_size
    tables, next_block = [], 0
    for p in prompts:
        n = math.ceil(len(p) / bs)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    step = upload(host_step([np.array(p) for p in prompts], [0] * len(prompts), tables,
                            [list(range(len(p))) for p in prompts], bs), runner.device)
    with torch.inference_mode():
        hidden = runner.model(step.input_ids, step.positions, step.meta)
        logits = runner.model.compute_logits(hidden[step.logits_rows])
    return list(logits.split([len(p) for p in prompts]))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_greedy_match_transformers(make_llama, variant):
    path = make_llama(**VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine(path, max_model_len=256)

    for prompt, logits in zip(PROMPTS, prefill_logits(engine, PROMPTS)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        rel = (logits - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"{variant}: prompt of {len(prompt)} tokens, relative error {rel:.2e}"

    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == ref, f"{variant}: prompt of {len(prompt)} tokens diverged"
        assert out.finish_reason == "length"
