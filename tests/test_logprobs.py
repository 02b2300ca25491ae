"""Logprobs are the log_softmax of the target's raw logits (fp32) at the position that produced
each generated token, whatever the sampling settings: greedy and sampled, with and without
drafts (an accepted draft's logprob comes from its verify row), chunked prefill, and exactly one
per token after a stop string cuts a multi-token step. Oracle: transformers' model over the
full context (hf_reference), compared at 1e-4 (the engine's paged fp32 forward differs from it
by ~1e-6)."""
from __future__ import annotations

import numpy as np
import pytest
from engine_checks import run_checked
from hf_reference import HFReference
from oracle_proposer import OracleProposer

from atom_like import LLMEngine, SamplingParams

rng = np.random.default_rng(7)
PROMPTS = [[int(x) for x in rng.integers(1, 128, n)] for n in (4, 23, 9)]
TOP = 5
ATOL = 1e-4


@pytest.fixture(scope="module")
def target(make_llama) -> str:
    return make_llama(tokenizer=True)


@pytest.fixture(scope="module")
def reference(target) -> HFReference:
    return HFReference(target)


@pytest.fixture(scope="module")
def greedy_paths(target) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    return [o.token_ids for o in LLMEngine(target, max_model_len=64).generate(PROMPTS, params, use_tqdm=False)]


def assert_logprobs_match(reference: HFReference, prompt: list[int], out) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids), (
        f"{len(out.logprobs or [])} logprobs for {len(out.token_ids)} tokens")
    expected = reference.generated_logprobs(prompt, out.token_ids)
    for n, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(expected[n, token], abs=ATOL), f"token {n}"
        top_ids = np.argsort(-expected[n], kind="stable")[:TOP]
        assert set(lp.top) == {int(t) for t in top_ids}, f"token {n}: top {TOP} ids differ"
        for t, v in lp.top.items():
            assert v == pytest.approx(expected[n, t], abs=ATOL)


def oracle_engine(target, paths, k, **kwargs) -> LLMEngine:
    """Drafts from the greedy paths, corrupted so that the accepted count cycles 0..k per step."""
    continuations = {f"r{i}": path for i, path in enumerate(paths)}
    corrupt = lambda rid, n, j: j >= (int(rid[1:]) + n) % (k + 1)  # noqa: E731
    return LLMEngine(target, max_model_len=64, **kwargs,
                     proposer_factory=lambda r: OracleProposer(r, continuations, k, corrupt))


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=20, logprobs=TOP, ignore_eos=True),
    # tempered and truncated sampling: logprobs still report the raw distribution
    "sampled": SamplingParams(temperature=0.6, top_k=20, top_p=0.9, max_tokens=20, logprobs=TOP, ignore_eos=True,
                              seed=5),
    # cool enough to stay near the greedy path, so drafts from it are accepted by rejection sampling
    "cool": SamplingParams(temperature=0.1, top_p=0.9, max_tokens=20, logprobs=TOP, ignore_eos=True, seed=5),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case,drafts", [("greedy", False), ("greedy", True), ("sampled", False), ("cool", True)])
def test_logprobs_are_log_softmax_of_the_raw_logits(target, reference, greedy_paths, case, drafts):
    params = CASES[case]
    kwargs = dict(max_num_batched_tokens=16)  # the 23-token prompt is prefilled in chunks
    engine = oracle_engine(target, greedy_paths, 3, **kwargs) if drafts else LLMEngine(target, max_model_len=64, **kwargs)
    outs = run_checked(engine, PROMPTS, params, request_ids=[f"r{i}" for i in range(len(PROMPTS))])
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.token_ids) == params.max_tokens
        assert_logprobs_match(reference, prompt, out)
    if drafts:
        assert sum(engine.spec_stats.accepted_histogram[2:]) > 0  # steps with several accepted drafts
    if case == "greedy":
        assert [o.token_ids for o in outs] == [p[:params.max_tokens] for p in greedy_paths]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("drafts", [False, True])
def test_no_logprob_past_a_stop_string(target, reference, greedy_paths, drafts):
    """The stop string completes inside a step that brought more tokens (drafts all accepted):
    tokens and logprobs are both cut right after the token that completed it."""
    prompt, path, k = PROMPTS[0], greedy_paths[0], 4
    # " w<id>" of the token at `cut` appears nowhere earlier in the text (not even as a prefix of
    # " w<id'>"), and with drafts it is not the last of its step's k + 1 tokens (the prefill brings token 0)
    cut = next(n for n in range(6, 20) if not any(f"w{t}".startswith(f"w{path[n]}") for t in path[:n])
               and (n - 1) % (k + 1) != k)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, stop=[f" w{path[cut]}"])
    if drafts:
        continuations = {"r0": path}
        engine = LLMEngine(target, max_model_len=64,
                           proposer_factory=lambda r: OracleProposer(r, continuations, k))
    else:
        engine = LLMEngine(target, max_model_len=64)
    (out,) = run_checked(engine, [prompt], params, request_ids=["r0"])
    assert out.finish_reason == "stop" and out.token_ids == path[:cut + 1]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    expected = reference.generated_logprobs(prompt, out.token_ids)
    for n, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(expected[n, out.token_ids[n]], abs=ATOL)
    if drafts:  # every draft was accepted: the stop string completed inside a multi-token step
        assert engine.spec_stats.accepted_histogram[:k] == [0] * k


def test_step_outputs_are_what_their_step_gave_when_read_later(target, greedy_paths):
    """RequestOutput's lists are taken from the sequence when first read (a step makes one output
    for every request it touched; copying them all each step cost host time that grew with the
    context): an output kept unread while the request runs on still reads as its own step's."""
    engine = LLMEngine(target, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    engine.add_request(None, params, request_id="r", prompt_ids=PROMPTS[1])
    kept, read_at_once = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            kept.append(out)
            read_at_once.append((list(out.prompt_token_ids), list(out.token_ids), [lp.token_id for lp in out.logprobs]))
    assert len(kept) > 2 and kept[-1].token_ids == greedy_paths[1]
    late = [(out.prompt_token_ids, out.token_ids, [lp.token_id for lp in out.logprobs]) for out in kept]
    assert late == read_at_once  # read after the request finished: each its own step's
    assert [len(t) for _, t, _ in late] == list(range(1, 31)) == [out.num_tokens for out in kept]
    assert all(p == PROMPTS[1] for p, _, _ in late)
    assert all(lp == t for _, t, lp in late)
    kept[0].token_ids.append(-1)  # the caller's own list
    assert kept[1].token_ids[:2] == greedy_paths[1][:2] and kept[0] != kept[1] and kept[1] == kept[1]
