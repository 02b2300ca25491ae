"""Sampling through the engine has exactly the distribution plain sampling from the target has:
over a grid of (temperature, top_k, top_p), in batches that mix greedy and sampled requests, and
through speculative verification (accepted drafts, the residual after a rejection, the bonus
token after all k drafts pass). Seeded requests with drafts give the same tokens alone and batched.

The expected distributions come from transformers' model (hf_reference), float64, written out
independently of the engine's sampling code. Each chi-square must reach P_FLOOR; with the 15
chi-squares below, a correct engine fails a CI run with probability below 15 * P_FLOOR = 1.5e-3,
while every planted sampling bug we tried drives p below 1e-15.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from engine_checks import run_checked
from hf_reference import HFReference, chisquare_pvalue, sampling_distribution
from oracle_proposer import OracleProposer

from atom_like import LLMEngine, SamplingParams

P_FLOOR = 1e-4
rng = np.random.default_rng(11)
PROMPTS = [[int(x) for x in rng.integers(0, 128, 5)] for _ in range(4)]

# (temperature, top_k, top_p): plain temperature both ways, top-p where tempering moves the cut
# (it keeps a different set than the untempered probabilities would), top-k alone and with top-p
GRID = [(1.0, -1, 1.0), (0.5, -1, 1.0), (0.7, -1, 0.8), (1.3, -1, 0.7), (0.8, 6, 1.0), (1.5, 10, 0.8)]
SAMPLES_PER_CONFIG = 1500


@pytest.fixture(scope="module")
def reference(llama_path) -> HFReference:
    return HFReference(llama_path)


@pytest.mark.timeout(600)
def test_grid_in_one_mixed_batch(llama_path, reference):
    """All grid configurations and greedy requests share the batch (interleaved), one token each."""
    logits = reference.next_logits(PROMPTS)
    requests = []  # (prompt index, params or None for greedy)
    for i in range(SAMPLES_PER_CONFIG):
        for c, (t, k, p) in enumerate(GRID):
            requests.append((c % len(PROMPTS), SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=1)))
        if i % 50 == 0:
            requests.append((i % len(PROMPTS), SamplingParams(temperature=0, max_tokens=1)))
    engine = LLMEngine(llama_path, max_model_len=16, max_num_seqs=len(requests), enforce_eager=True,
                       max_num_batched_tokens=5 * len(requests))
    outs = run_checked(engine, [PROMPTS[i] for i, _ in requests], [sp for _, sp in requests])

    for (i, sp), out in zip(requests, outs):
        if sp.temperature == 0:
            assert out.token_ids == [int(np.argmax(logits[i]))], "a greedy row of a mixed batch did not take the argmax"
    for c, (t, k, p) in enumerate(GRID):
        i = c % len(PROMPTS)
        expected = sampling_distribution(logits[i], t, k, p)
        if p < 1.0 and k < 0:  # the test can see top-p computed from untempered probabilities
            assert ((sampling_distribution(logits[i], 1.0, k, p) > 0) != (expected > 0)).any()
        tokens = [out.token_ids[0] for (_, sp), out in zip(requests, outs)
                  if (sp.temperature, sp.top_k, sp.top_p) == (t, k, p)]
        assert len(tokens) == SAMPLES_PER_CONFIG
        pvalue = chisquare_pvalue(tokens, expected)
        assert pvalue > P_FLOOR, f"T={t} top_k={k} top_p={p}: chi-square p={pvalue:.2e}"


def _oracle_engine(target, continuation, k, **kwargs) -> LLMEngine:
    continuations = defaultdict(lambda: continuation)  # every request proposes the same greedy path
    return LLMEngine(target, proposer_factory=lambda r: OracleProposer(r, continuations, k),
                     **{"max_model_len": 32, **kwargs})


@pytest.mark.timeout(600)
@pytest.mark.parametrize("k,config", [(1, (0.5, 4, 1.0)), (2, (0.7, 5, 0.9))])
def test_speculative_sampling_marginals_and_the_bonus_token(llama_path, reference, k, config):
    """Drafts = the greedy path, k + 2 tokens per request: the prefill samples t1, the next step
    verifies k drafts. Every generated token follows the target's exact marginal, whichever of
    accept / residual / bonus produced it; and given t1..t(k+1) == the greedy path (so all k drafts
    were accepted), t(k+2) is the bonus token, drawn from p(. | greedy path). Greedy requests in
    the same batch follow the greedy path exactly."""
    (t, top_k, top_p), prompt, n = config, PROMPTS[1], 3000
    params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, max_tokens=k + 2, ignore_eos=True)
    greedy_params = SamplingParams(temperature=0, max_tokens=k + 2, ignore_eos=True)
    greedy = LLMEngine(llama_path, max_model_len=32).generate([prompt], greedy_params, use_tqdm=False)[0].token_ids
    engine = _oracle_engine(llama_path, greedy, k, max_num_seqs=n + 10, max_num_batched_tokens=8 * (n + 10))
    outs = run_checked(engine, [prompt] * (n + 10), [params] * n + [greedy_params] * 10)
    assert all(o.token_ids == greedy for o in outs[n:]), "greedy rows of a mixed batch left the greedy path"
    samples = np.array([o.token_ids for o in outs[:n]])

    # the exact joint law of t1..t(k+2), level by level over the support tree
    paths, marginals, next_dist = {(): 1.0}, [], {}
    for _ in range(k + 2):
        prefixes = list(paths)
        dists = [sampling_distribution(row, t, top_k, top_p)
                 for row in reference.next_logits([prompt + list(pre) for pre in prefixes])]
        next_dist.update(zip(prefixes, dists))
        marginals.append(sum(paths[pre] * d for pre, d in zip(prefixes, dists)))
        paths = {pre + (int(tok),): paths[pre] * d[tok] for pre, d in zip(prefixes, dists) for tok in np.flatnonzero(d)}
    for j, expected in enumerate(marginals):
        pvalue = chisquare_pvalue(samples[:, j], expected)
        assert pvalue > P_FLOOR, f"token {j + 1}: chi-square p={pvalue:.2e}"

    bonus = (samples[:, :k + 1] == greedy[:k + 1]).all(axis=1)
    expected = next_dist[tuple(greedy[:k + 1])]
    assert bonus.sum() > 50 and expected.max() < 0.8  # enough bonus tokens, from a non-degenerate p
    pvalue = chisquare_pvalue(samples[bonus, k + 1], expected)
    assert pvalue > P_FLOOR, f"bonus token: chi-square p={pvalue:.2e}"
    assert engine.spec_stats.accepted_histogram[k] > 50


@pytest.mark.timeout(600)
@pytest.mark.parametrize("k", [1, 3])
def test_seeded_requests_with_drafts_are_batch_invariant(llama_path, k):
    """A seeded request draws its acceptance tests, residual and bonus tokens from its own
    generator: the same tokens alone and among unseeded neighbours, and other tokens with
    another seed."""
    prompts = PROMPTS[:3]
    greedy = LLMEngine(llama_path, max_model_len=64).generate(
        prompts[:1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0].token_ids
    engine = _oracle_engine(llama_path, greedy, k, max_model_len=64)

    def seeded(seed):
        return SamplingParams(temperature=0.5, top_p=0.95, max_tokens=24, seed=seed, ignore_eos=True)

    alone = [run_checked(engine, [prompts[0]], seeded(s))[0].token_ids for s in (1, 2, 3)]
    assert engine.spec_stats.num_accepted_tokens > 0
    noisy = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = run_checked(engine, [prompts[1], prompts[0], prompts[2], prompts[0], prompts[0]],
                        [noisy, seeded(1), noisy, seeded(2), seeded(3)])
    assert [batch[1].token_ids, batch[3].token_ids, batch[4].token_ids] == alone
    assert len({tuple(a) for a in alone}) == 3
