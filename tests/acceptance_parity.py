"""Shared by the CPU and GPU acceptance tests: the accepted-draft counts of each verify step, from
the engine and from the plain eager reference loop (transformers target + the draft as a plain
torch module, no paging: eagle3_train.eagle3_reference), on the same chat prompts."""
from __future__ import annotations

import torch

from atom_like import LLMEngine, SamplingParams
from eagle3_train.eagle3_reference import load_draft, reference_speculate
from eagle3_train.targets import load_target


def chat_prompts(tokenizer, chats) -> list[list[int]]:
    return [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for c in chats]


def engine_counts(target: str, draft: str, prompts: list[list[int]], k: int, max_new: int, **engine_args) -> list[list[int]]:
    """Per prompt (run alone, so every observed verify step is its own), accepted drafts per step."""
    engine = LLMEngine(target, method="eagle3", draft_model=draft, num_speculative_tokens=k, speculative_adaptive=False,
                       **engine_args)
    counts: list[int] = []
    observe = engine.spec_stats.observe
    engine.spec_stats.observe = lambda drafted, accepted: (counts.append(accepted), observe(drafted, accepted))
    out = []
    for prompt in prompts:
        counts.clear()
        engine.generate([prompt], SamplingParams(temperature=0, max_tokens=max_new), use_tqdm=False)
        out.append(list(counts))
    return out


def reference_counts(target: str, draft: str, prompts: list[list[int]], k: int, max_new: int, dtype=torch.float32,
                     device: str = "cpu") -> list[list[int]]:
    model, _, stop = load_target(target, dtype, device)
    drafter = load_draft(draft, model, dtype).to(device)
    with torch.no_grad():
        return [reference_speculate(model, drafter, p, k, max_new, stop)[1] for p in prompts]


def mean_acceptance_length(counts: list[list[int]]) -> float:
    steps = [c for per_prompt in counts for c in per_prompt]
    return 1 + sum(steps) / max(len(steps), 1)
