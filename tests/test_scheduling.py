"""Scheduling must not change results: late arrivals, chunked prefill and preemption all give
the tokens each request gets alone; and every block comes back. Every engine here runs with the
invariants of engine_checks asserted at each step (a leak or an over-admission fails at once)."""
from __future__ import annotations

import numpy as np
import pytest
from engine_checks import install_checks, run_checked

from atom_like import LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
rng = np.random.default_rng(1)
PROMPTS = [[int(x) for x in rng.integers(0, 128, n)] for n in (5, 37, 12, 64, 3, 20)]


@pytest.fixture(scope="module")
def alone(llama_path):
    engine = LLMEngine(llama_path, max_model_len=128)
    return [engine.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]


def assert_no_leak(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_batched_equals_alone(llama_path, alone):
    engine = LLMEngine(llama_path, max_model_len=128)
    assert [o.token_ids for o in run_checked(engine, PROMPTS, GREEDY)] == alone
    assert_no_leak(engine)


def test_requests_arriving_mid_decode(llama_path, alone):
    engine = LLMEngine(llama_path, max_model_len=128)
    install_checks(engine)
    done = {}
    pending = list(enumerate(PROMPTS))
    step = 0
    while pending or engine.has_unfinished_requests():
        assert step < 200, "no end: livelock?"
        if pending and step % 3 == 0:  # a new request joins every third step
            i, p = pending.pop(0)
            engine.add_request(p, GREEDY, request_id=str(i))
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.token_ids
        step += 1
    assert [done[i] for i in range(len(PROMPTS))] == alone
    assert_no_leak(engine)


def test_chunked_prefill(llama_path, alone):
    engine = LLMEngine(llama_path, max_model_len=128, max_num_batched_tokens=8)
    checks = install_checks(engine)
    assert [o.token_ids for o in run_checked(engine, PROMPTS, GREEDY)] == alone
    assert checks.max_batch_tokens == 8
    assert_no_leak(engine)


@pytest.mark.parametrize("budget", [8, 13])
def test_prompts_one_token_past_a_chunk_boundary(llama_path, budget):
    """Prompts of budget - 1 .. budget + 1 and 2 * budget + 1 tokens, alone and batched: the last
    chunk of a prompt is the only one that samples, whatever it has left (1 token included)."""
    g = np.random.default_rng(budget)
    prompts = [[int(x) for x in g.integers(0, 128, n)] for n in (budget + 1, budget, budget - 1, 2 * budget + 1)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    unchunked = LLMEngine(llama_path, max_model_len=64)
    expected = [o.token_ids for o in unchunked.generate(prompts, params, use_tqdm=False)]
    engine = LLMEngine(llama_path, max_model_len=64, max_num_batched_tokens=budget)
    assert [run_checked(engine, [p], params)[0].token_ids for p in prompts] == expected
    assert [o.token_ids for o in run_checked(engine, prompts, params)] == expected


def test_max_num_seqs_is_never_exceeded(llama_path, alone):
    engine = LLMEngine(llama_path, max_model_len=128, max_num_seqs=2)
    checks = install_checks(engine)
    assert [o.token_ids for o in run_checked(engine, PROMPTS, GREEDY)] == alone
    assert checks.max_running == 2
    assert_no_leak(engine)


def test_preemption_by_recompute(llama_path, alone):
    # 8 blocks of 16 tokens = room for one 128-token sequence: six requests must take turns
    engine = LLMEngine(llama_path, max_model_len=128, num_kv_blocks=8)
    install_checks(engine, sentinel=True)
    outs = run_checked(engine, PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert engine.scheduler.num_preemptions > 0
    assert_no_leak(engine)


def test_abort_frees_blocks(llama_path):
    engine = LLMEngine(llama_path, max_model_len=128, num_kv_blocks=8)
    install_checks(engine)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), request_id=str(i))
    for _ in range(6):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for i in range(0, len(PROMPTS), 2):
        engine.abort_request(str(i))  # running or waiting: its blocks come back at once
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert_no_leak(engine)
