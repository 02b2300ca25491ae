"""Sampling: reproducible with a seed, top_k=1 is greedy, and the empirical distribution of
temperature / top-k / top-p sampling matches the processed softmax."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from chi_square import P_FLOOR, chi_square_pvalue

from atom_like import LLMEngine, SamplingParams
from model_ops.sampling import SamplingTensors, processed_probs, verify

PROMPTS = [[3, 17, 42, 9], [100, 2, 5]]


def test_seeded_sampling_is_reproducible_across_batches(llama_path):
    engine = LLMEngine(llama_path, max_model_len=128)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].token_ids
    noisy = SamplingParams(temperature=1.3, max_tokens=16, ignore_eos=True)  # unseeded neighbours
    together = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[1]], [noisy, seeded, noisy], use_tqdm=False)
    assert together[1].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99, ignore_eos=True)
    assert engine.generate([PROMPTS[0]], other_seed, use_tqdm=False)[0].token_ids != alone


def test_top_k_1_equals_greedy(llama_path):
    engine = LLMEngine(llama_path, max_model_len=128)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    top1 = engine.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=1, max_tokens=20, ignore_eos=True),
                           use_tqdm=False)
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


SAMPLING_SEED = 0  # the sampler's seed in the distribution test (seeds 0..19 all passed: see its docstring)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.0, -1, 0.8), (1.5, 5, 0.9),
                                                     (1.0, 4, 1.0)])
def test_empirical_distribution_matches_softmax(temperature, top_k, top_p):
    """Chi-square in float64, p >= chi_square.P_FLOOR (1e-3). Run once over sampler seeds 0..19
    for each case (80 runs): p from 0.0063 to 0.98, one below 0.05; seed 0, kept here, gives
    0.65 / 0.28 / 0.19 / 0.26."""
    vocab, n = 12, 40000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(7)) * 2
    st = SamplingTensors.build([temperature] * n, [top_k] * n, [top_p] * n, [None] * n, vocab, torch.device("cpu"))
    # verification without draft tokens is plain sampling (the engine's one sampling path)
    verified = verify(logits.expand(n, vocab), [0] * n, torch.zeros(0, dtype=torch.long), st,
                      torch.Generator().manual_seed(SAMPLING_SEED))
    counts = np.bincount(verified.token_ids[:, 0].numpy(), minlength=vocab)

    # the expected distribution, written out directly: top-k first, then top-p over the
    # renormalised top-k set (the order transformers' warpers and vLLM use)
    p = torch.softmax(logits[0].double() / temperature, -1)
    order = p.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    topk_mass = sum(p[t].item() for t in order)
    keep = torch.zeros(vocab, dtype=torch.bool)
    mass = 0.0
    for rank, t in enumerate(order):
        if rank > 0 and mass >= top_p:
            break
        keep[t] = True
        mass += p[t].item() / topk_mass
    expected = torch.where(keep, p, 0.0)
    expected = (expected / expected.sum()).numpy()
    assert counts[~keep.numpy()].sum() == 0, "sampled a token outside top-k/top-p"
    np.testing.assert_allclose(processed_probs(logits, SamplingTensors.build([temperature], [top_k], [top_p], [None], vocab,
                                                                     torch.device("cpu")))[0].numpy(), expected, atol=1e-6)
    support = keep.numpy()
    pvalue = chi_square_pvalue(counts[support], expected[support])
    assert pvalue >= P_FLOOR, f"chi-square p={pvalue:.2e}"


def test_logprobs_are_log_softmax(llama_path):
    engine = LLMEngine(llama_path, max_model_len=128)
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert max(lp.top.values()) == pytest.approx(lp.logprob)  # greedy picks the most likely token
        assert all(v <= 0 for v in lp.top.values())


@pytest.mark.parametrize("top_k,top_p,width", [
    ([-1, -1], [1.0, 1.0], 0),  # nothing filters: no sort at all
    ([5, 9], [1.0, 0.9], 9),  # every row has a top-k: the largest 9, top-p applied within them
    ([5, -1], [1.0, 1.0], None),  # a row keeps every token: the whole order
    ([-1, -1], [0.9, 1.0], None),  # a top-p without a top-k needs the whole order
    ([40, 3], [1.0, 1.0], None),  # a top-k past the vocabulary is no top-k
])
def test_sorting_only_what_the_filters_need(top_k, top_p, width):
    """processed_probs orders only the largest top-k logits when every row has a top-k, nothing when no
    row filters; the distribution is the one the whole-vocabulary sort gives (distinct logits)."""
    vocab = 32
    st = SamplingTensors.build([0.8, 1.3], top_k, top_p, [None, None], vocab, torch.device("cpu"))
    assert st.sort_width == width
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3)) * 3
    full = dataclasses.replace(st, sort_width=None)
    torch.testing.assert_close(processed_probs(logits, st), processed_probs(logits, full), rtol=1e-6, atol=1e-7)
