"""Sampling and verification on the GPU (skipped without CUDA/ROCm): the rejection sampler's
output follows the target distribution (chi-square, the CPU test's method on the device path),
seeded sampling with an EAGLE3 draft is reproducible alone and batched, and decode steps at
temperature 0 and 1, with and without drafts, make no implicit host synchronisation
(torch.cuda.set_sync_debug_mode), which issue 14's overlap requires."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from chi_square import P_FLOOR, chi_square_pvalue

from atom_like import LLMEngine, SamplingParams
from model_ops.sampling import SamplingTensors, processed_probs, verify

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")

GPU_LLAMA = dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def test_rejection_sampling_keeps_the_target_distribution():
    """Each of n sequences verifies one draft drawn from q against the target p (top-p 0.9): the
    token a sequence emits first (its accepted draft, or the resample from max(p - q, 0)) is
    distributed as p. Chi-square in float64, p >= chi_square.P_FLOOR."""
    vocab, n, dev = 12, 40000, torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    target_logits, draft_logits = torch.randn(vocab, generator=g) * 2, torch.randn(vocab, generator=g) * 2
    q = torch.softmax(draft_logits, -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    logits = target_logits.expand(2 * n, vocab).contiguous().to(dev)  # rows: after 0 drafts, after 1
    st = SamplingTensors.build([1.0] * 2 * n, [-1] * 2 * n, [0.9] * 2 * n, [None] * 2 * n, vocab, dev)
    verified = verify(logits, [1] * n, drafts.to(dev), st, torch.Generator(device=dev).manual_seed(0),
                      draft_probs=q.expand(n, vocab).to(dev))
    first = verified.token_ids[:, 0].cpu().numpy()
    expected = processed_probs(target_logits[None].to(dev), SamplingTensors.build([1.0], [-1], [0.9], [None], vocab, dev))
    expected = expected[0].double().cpu().numpy()
    support = expected > 0
    counts = np.bincount(first, minlength=vocab)
    assert counts[~support].sum() == 0
    accepted = verified.num_accepted.float().mean().item()
    assert 0.2 < accepted < 0.95  # both branches taken often
    pvalue = chi_square_pvalue(counts[support], expected[support] / expected[support].sum())
    assert pvalue >= P_FLOOR, f"chi-square p={pvalue:.2e}"


@pytest.fixture(scope="module")
def pair(make_llama, make_eagle3_llama):
    path = make_llama(**GPU_LLAMA)
    return path, make_eagle3_llama(path, aux_layer_ids=[0, 1, 2])


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(0, 2048, int(rng.integers(8, 40)))] for _ in range(n)]


def test_seeded_sampling_with_a_draft_is_reproducible_batched(pair):
    path, draft = pair
    engine = LLMEngine(path, dtype="bfloat16", max_model_len=192, gpu_memory_utilization=0.3, max_num_seqs=16,
                       method="eagle3", draft_model=draft, num_speculative_tokens=3)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=32, seed=1234, ignore_eos=True)
    prompt = prompts(1, 1)[0]
    alone = engine.generate([prompt], seeded, use_tqdm=False)[0].token_ids
    noisy = SamplingParams(temperature=1.2, max_tokens=40, ignore_eos=True)
    others = prompts(5, 2)
    together = engine.generate(others[:2] + [prompt] + others[2:], [noisy, noisy, seeded, noisy, noisy, noisy],
                               use_tqdm=False)
    assert together[2].token_ids == alone
    assert engine.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=32, seed=99, ignore_eos=True),
                           use_tqdm=False)[0].token_ids != alone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("spec", [False, True])
def test_decode_steps_make_no_implicit_synchronisation(pair, temperature, spec):
    """Overlapped decode steps (graphs) at batch 8: after warm-up, 12 steps under torch's sync
    debug mode raise nothing (the one intended wait, the step's event, is not an implicit sync)."""
    path, draft = pair
    kwargs = dict(method="eagle3", draft_model=draft, num_speculative_tokens=3) if spec else {}
    engine = LLMEngine(path, dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3, max_num_seqs=16, **kwargs)
    params = SamplingParams(temperature=temperature, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(prompts(8, 3)):
        engine.add_request(None, params, request_id=f"r{i}", prompt_ids=p)
    for _ in range(8):  # prefill and warm-up
        engine.step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(12):
                engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert not syncs, syncs[:3]
