"""bf16 on the GPU: the engine's mean acceptance length for each shipped tiny-kimi draft (and the
SmolLM2 draft, when a training run left it in the zoo cache) is within
1% of the plain eager reference loop's (transformers target + plain-module draft; the zoo's fast
replay of reference_speculate, which a CPU test checks step for step), over held-out prompts.
Per-step identity is a CPU/fp32 property (tests/test_zoo_shipped.py): in bf16 the two paths flip
near-ties differently, so here the comparison is of the mean over ~128 prompts."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from atom_like import LLMEngine, SamplingParams
from atom_like.zoo import resolve
from atom_like.zoo.registry import locate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
PROMPTS = Path(os.environ.get("ATOM_LIKE_EVAL_PROMPTS", ".stage/eval_prompts.jsonl"))
K, MAX_NEW = 3, 128
# prompts per set (ShareGPT, GSM8K); more shrink the bf16 noise of both means (the file has 154 / 256)
PER_SET = int(os.environ.get("ATOM_LIKE_PARITY_PER_SET", "64"))


@pytest.mark.skipif(not PROMPTS.is_file(), reason=f"held-out prompts not staged at {PROMPTS}")
@pytest.mark.parametrize("target,draft", [("tiny-kimi", "tiny-kimi-eagle3"), ("tiny-kimi", "tiny-kimi-eagle3-mla"),
                                          ("tiny-kimi", "tiny-kimi-eagle3.1-mla"),
                                          ("smollm2-135m", "smollm2-135m-eagle3")])
def test_bf16_acceptance_matches_reference(target, draft):
    from acceptance_parity import chat_prompts

    from eagle3_train.acceptance import evaluate, load_eval_prompts
    from eagle3_train.eagle3_reference import load_draft
    from eagle3_train.targets import load_target

    if locate(target) is None or locate(draft) is None:
        pytest.skip(f"{target} / {draft} not in the zoo cache (ATOM_LIKE_CACHE); ci/train_zoo.sh builds them")
    target = str(resolve(target))
    sets = load_eval_prompts(PROMPTS, PER_SET)
    model, tok, stop = load_target(target, torch.bfloat16, "cuda")
    drafter = load_draft(resolve(draft), model, torch.bfloat16).cuda()
    ref = evaluate(model, drafter, tok, sets, stop, ks=(K,), max_new_tokens=MAX_NEW)
    del model, drafter
    torch.cuda.empty_cache()

    engine = LLMEngine(target, dtype="bfloat16", method="eagle3", draft_model=str(resolve(draft)),
                       num_speculative_tokens=K, speculative_adaptive=False, max_model_len=4096, gpu_memory_utilization=0.3)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)

    def engine_al(chunk: int) -> tuple[float, int]:
        """Mean acceptance length with the prompts sent `chunk` at a time (other batch shapes)."""
        before = (engine.spec_stats.num_drafts, engine.spec_stats.num_accepted_tokens)
        for chats in sets.values():
            prompts = chat_prompts(tok, chats)
            for lo in range(0, len(prompts), chunk):
                engine.generate(prompts[lo: lo + chunk], params, use_tqdm=False)
        drafts = engine.spec_stats.num_drafts - before[0]
        return 1 + (engine.spec_stats.num_accepted_tokens - before[1]) / drafts, drafts

    ref_steps = sum(ref[name][f"k{K}"]["steps"] for name in sets)
    ref_al = 1 + sum(ref[name][f"k{K}"]["accepted"] for name in sets) / ref_steps
    batched, steps = engine_al(64)
    # The same engine with 8 prompts per batch: how far bf16 batch shapes alone move the mean.
    chunked, _ = engine_al(8)
    print(f"{draft}: mean acceptance length at k={K}: engine {batched:.3f} ({steps} steps), "
          f"reference {ref_al:.3f} ({ref_steps} steps); engine at 8 prompts a batch {chunked:.3f}")
    assert abs(batched - ref_al) <= 0.01 * ref_al
