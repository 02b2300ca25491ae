"""Logits processors (logit_bias, min_tokens, presence / frequency / repetition penalties) and
prompt logprobs, in the engine: each changes what it should, the batched processors equal a
row-by-row reference with every draft position's own history, and speculation stays
token-identical to plain greedy decoding with the same processors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from oracle_proposer import OracleProposer

from atom_like import LLMEngine, SamplingParams
from atom_like.engine.sampler import row_logits_processors
from atom_like.engine.sequence import Sequence
from atom_like.engine.step_inputs import SeqStep

VOCAB = 128
PROMPTS = [[3, 17, 42, 9, 3], [100, 2, 5], [7, 7, 7, 7, 1, 2]]
REPETITIVE = dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.8)


@pytest.fixture(scope="module")
def target(llama_path):
    return llama_path


@pytest.fixture(scope="module")
def engine(target):
    return LLMEngine(target, max_model_len=128)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 24, "ignore_eos": True, **kwargs})


def run(engine, prompts, params):
    return [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


# ----------------------------------------------------------------------------- the math

def reference(logits: torch.Tensor, seq: Sequence, history: list[int], num_generated: int) -> torch.Tensor:
    """One row, written out token by token as vLLM documents the processors."""
    p, x = seq.params, logits.clone()
    for token, bias in p.logit_bias.items():
        x[token] += bias
    if num_generated < p.min_tokens:
        x[seq.stop_ids] = float("-inf")
    prompt = seq.token_ids[:seq.num_prompt_tokens]
    for token in set(prompt) | set(history):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(history):
        x[token] -= p.frequency_penalty * history.count(token) + p.presence_penalty
    return x


def decode_steps(seqs: list[Sequence], drafts: list[list[int]]) -> list[SeqStep]:
    """What the runner gets of each sequence in a decode step verifying `drafts` (StepBatch)."""
    return [SeqStep.of(seq, seq.num_tokens - 1, 1, d, samples=True, shift_bound=None) for seq, d in zip(seqs, drafts)]


def test_batched_processors_equal_the_row_by_row_reference():
    rng = np.random.default_rng(0)
    seqs, drafts = [], []
    settings = [dict(logit_bias={5: -100.0, 9: 3.5}), dict(min_tokens=6, max_tokens=10), dict(**REPETITIVE),
                dict(), dict(repetition_penalty=0.7, logit_bias={1: 2.0}, min_tokens=3, max_tokens=5)]
    for i, extra in enumerate(settings):
        seq = Sequence(str(i), rng.integers(0, VOCAB, 7).tolist(), SamplingParams(**extra), stop_ids=[0, 11])
        seq.token_ids += rng.integers(0, 20, 4).tolist()  # generated so far: small ids, so they repeat
        seqs.append(seq)
        drafts.append(rng.integers(0, 20, i % 4).tolist())
    rows = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    processed = row_logits_processors(decode_steps(seqs, drafts), VOCAB, torch.device("cpu"))(logits)
    row = 0
    for seq, d in zip(seqs, drafts):
        for j in range(len(d) + 1):
            expected = reference(logits[row], seq, seq.generated_ids + d[:j], seq.num_generated + j)
            torch.testing.assert_close(processed[row], expected)
            row += 1
    assert row_logits_processors(decode_steps(seqs[3:4], drafts[3:4]), VOCAB, torch.device("cpu")) is None  # nothing asked


# ----------------------------------------------------------------------------- in the engine

def test_logit_bias_changes_the_greedy_token(engine):
    plain = run(engine, PROMPTS[:1], greedy(max_tokens=4))[0]
    biased = run(engine, PROMPTS[:1], greedy(max_tokens=4, logit_bias={plain[0]: -100.0}))[0]
    assert biased[0] != plain[0] and plain[0] not in biased
    favoured = run(engine, PROMPTS[:1], greedy(max_tokens=4, logit_bias={77: 100.0}))[0]
    assert favoured == [77] * 4


def test_penalties_change_repetitive_output(engine):
    plain = run(engine, PROMPTS, greedy(max_tokens=24))
    penalised = run(engine, PROMPTS, greedy(max_tokens=24, **REPETITIVE))
    assert penalised != plain
    distinct = lambda outs: sum(len(set(o)) for o in outs)  # noqa: E731
    assert distinct(penalised) > distinct(plain)
    for name, value in REPETITIVE.items():  # each one alone changes something
        assert run(engine, PROMPTS, greedy(max_tokens=24, **{name: value})) != plain, name


def test_min_tokens_holds_back_stop_token_ids(engine):
    plain = run(engine, PROMPTS[:1], greedy(max_tokens=12))[0]
    stop = plain[0]
    assert run(engine, PROMPTS[:1], greedy(max_tokens=12, stop_token_ids=[stop]))[0] == [stop]
    held = run(engine, PROMPTS[:1], greedy(max_tokens=12, stop_token_ids=[stop], min_tokens=8))[0]
    assert len(held) >= 8 and stop not in held[:8]
    assert held[-1] == stop or len(held) == 12


def test_min_tokens_holds_back_eos(make_llama):
    engine = LLMEngine(make_llama(), max_model_len=128)
    first = run(engine, PROMPTS[:1], greedy(max_tokens=6))[0][0]
    engine.eos_token_ids.add(first)  # the greedy first token is EOS now (the scheduler shares the set)
    assert run(engine, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6))[0] == [first]
    held = run(engine, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, min_tokens=4))[0]
    assert len(held) >= 4 and first not in held[:4]


@pytest.mark.parametrize("k", [1, 3])
def test_speculation_with_processors_is_token_identical(target, engine, make_eagle3_llama, k):
    """A random draft (rarely accepted) and an oracle that proposes the processed greedy
    continuation (always accepted, so every row of every verify step is used): with penalties
    the history of draft position j includes drafts 0..j-1, or the output would differ."""
    params = [greedy(max_tokens=30, **REPETITIVE), greedy(max_tokens=30, logit_bias={3: 6.0, 50: -100.0}),
              greedy(max_tokens=30, min_tokens=20, stop_token_ids=[40, 41], ignore_eos=False)]
    expected = run(engine, PROMPTS, params)
    draft = make_eagle3_llama(target, aux_layer_ids=[0, 1, 2])
    spec = LLMEngine(target, max_model_len=128, method="eagle3", draft_model=draft, num_speculative_tokens=k)
    assert run(spec, PROMPTS, params) == expected
    oracle = LLMEngine(target, max_model_len=128, proposer_factory=lambda r: OracleProposer(
        r, {str(i): e for i, e in enumerate(expected)}, k))
    ids = [oracle.add_request(p, sp, request_id=str(i)) for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    done = {}
    while oracle.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in oracle.step() if o.finished})
    assert [done[i] for i in ids] == expected
    stats = oracle.spec_stats
    assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens  # the processed argmax matched the drafts


# ----------------------------------------------------------------------------- prompt logprobs

@pytest.mark.parametrize("speculation", [False, True])
def test_prompt_logprobs_are_log_softmax_of_the_prompt_forward(target, make_eagle3_llama, speculation):
    from transformers import AutoModelForCausalLM

    extra = dict(method="eagle3", draft_model=make_eagle3_llama(target, aux_layer_ids=[0, 1, 2]), num_speculative_tokens=2) if speculation else {}
    # chunked prefill: the prompt's logprobs come from three forwards
    engine = LLMEngine(target, max_model_len=128, max_num_batched_tokens=8, **extra)
    prompt = np.random.default_rng(5).integers(0, VOCAB, 21).tolist()
    out = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for p, lp in enumerate(out.prompt_logprobs[1:]):
        assert lp.token_id == prompt[p + 1]
        assert lp.logprob == pytest.approx(logp[p, prompt[p + 1]].item(), abs=1e-4)
        top = logp[p].topk(3)
        assert list(lp.top) == top.indices.tolist()
        np.testing.assert_allclose(list(lp.top.values()), top.values.numpy(), atol=1e-4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # with generation too: the same prompt numbers, and the generated tokens unchanged
    both = engine.generate([prompt], greedy(max_tokens=5, prompt_logprobs=0), use_tqdm=False)[0]
    assert [lp.logprob for lp in both.prompt_logprobs[1:]] == [lp.logprob for lp in out.prompt_logprobs[1:]]
    assert both.token_ids == engine.generate([prompt], greedy(max_tokens=5), use_tqdm=False)[0].token_ids
