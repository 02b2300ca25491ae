"""Prefix caching: the block manager's keys, reference counts and LRU; greedy tokens, accepted
counts and draft proposals identical with caching on and off (fp32) for every shared-prefix
length relative to the block size, without a draft and with the MHA and MLA drafts; no leaked
or double-owned block after any step of a workload mixing hits, evictions, preemption, aborts
and stops; the flag; the metrics."""
from __future__ import annotations

import argparse
from collections import Counter, defaultdict, deque

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from atom_like import EngineArgs, LLMEngine, SamplingParams
from atom_like.engine.block_manager import BlockManager
from atom_like.engine.sequence import Sequence
from atom_like.engine.step_inputs import SeqStep
from atom_like.entrypoints.metrics import (EngineState, HistogramSnapshot, PrefixCacheSnapshot, ServerMetrics,
                                           StatsLogger)

B = 8  # block size of the engine tests
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
rng = np.random.default_rng(11)
BASE = [int(x) for x in rng.integers(2, 128, 40)]


def other(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(2, 128, n)]


def diverge(token: int) -> int:
    return 2 + (token - 1) % 126  # another token in [2, 128)


# The warm-up request computes BASE; then these run together, sharing its blocks (and, for "whole"
# and "whole again", each other's). Expected hits in tokens without / with a draft, where the
# draft's keys cover the token after each block and the last prompt token is always recomputed.
WARM = BASE
CASES = {
    "none": (other(21, 1), 0, 0),
    "partial block": (BASE[:5] + other(12, 2), 0, 0),
    "exact blocks": (BASE[:16] + [diverge(BASE[16])] + other(6, 3), 16, 8),
    "blocks and a bit": (BASE[:19] + other(5, 4), 16, 16),
    "whole prompt": (BASE, 32, 32),
    "whole again": (BASE, 32, 32),
    "ends on a block boundary": (BASE[:24], 16, 16),
}


# ----------------------------------------------------------------------------- block manager alone

def computed(bm: BlockManager, tokens: list[int], name: str = "a") -> Sequence:
    """A sequence admitted with whatever `bm` has cached, then fully computed (blocks cached)."""
    seq = Sequence(name, tokens, SamplingParams())
    assert bm.allocate(seq, bm.cached_prefix(seq), len(tokens))
    before, seq.num_computed_tokens = seq.num_cached_tokens, len(tokens)
    bm.cache_computed_blocks(seq, before)
    return seq


@pytest.mark.parametrize("lookahead", [0, 1])
def test_keys_chain_the_prefix_and_cover_the_next_token_with_a_draft(lookahead):
    bm = BlockManager(16, 4, enable_prefix_caching=True, lookahead=lookahead)
    a = computed(bm, list(range(10, 21)))  # 11 tokens: full blocks 0, 1 (2 ends before the end)
    assert len(bm.block_of) == 2 and bm.key_of == dict(zip(a.block_table[:2], a.block_keys[:2]))

    def hits(tokens):
        return len(bm.cached_prefix(Sequence("b", tokens, SamplingParams()))) * 4

    assert hits(list(range(10, 21))) == 8  # the whole prompt: both cached blocks, the last token computed
    assert hits(list(range(10, 18)) + [99, 98]) == 8 - 4 * lookahead  # diverges right after block 1
    assert hits(list(range(10, 19)) + [99]) == 8  # one token later
    assert hits(list(range(10, 18))) == 4  # ends on a block boundary: its last block is recomputed
    assert hits([11] + list(range(11, 21))) == 0  # a different first block changes every key
    assert hits(list(range(10, 14)) + [0, 0, 0, 0, 20]) == 4 - 4 * lookahead  # block 1 differs


def test_a_block_is_found_only_after_its_own_prefix():
    """y and x share their second block's tokens, not their first: z, which starts like x, must
    take x's second block, not y's (its KV was computed after other tokens). The lookup stops at
    the first miss, so only a key that names the whole prefix tells the two apart."""
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    shared = [40, 41, 42, 43]
    computed(bm, [1, 2, 3, 4] + shared + [9], "y")
    x = computed(bm, [5, 6, 7, 8] + shared + [9], "x")
    assert bm.cached_prefix(Sequence("z", [5, 6, 7, 8] + shared + [10], SamplingParams())) == x.block_table[:2]


@pytest.mark.parametrize("lookahead", [0, 1])
def test_blocks_holding_generated_tokens_are_never_cached(lookahead):
    """Only blocks whose key tokens are all prompt tokens become findable (module docstring): a
    sequence decoding past its prompt caches nothing more, so a later prompt that repeats the
    generated text hits the prompt blocks only. With a draft the key covers the next token, so
    the prompt's last full block is left out too when that token is a generated one."""
    bm = BlockManager(16, 4, enable_prefix_caching=True, lookahead=lookahead)
    seq = Sequence("a", list(range(10, 18)), SamplingParams())  # 8 prompt tokens: 2 full blocks
    assert bm.allocate(seq, [], 8)
    for token in range(40, 50):  # the prefill, then decode steps, in Scheduler.update's order:
        before, seq.num_computed_tokens = seq.num_computed_tokens, seq.num_tokens  # the step's KV is written,
        bm.cache_computed_blocks(seq, before)  # its full blocks cached, then its sampled token appended
        seq.token_ids.append(token)
        assert bm.ensure_capacity(seq, seq.num_tokens)
    prompt_blocks = 2 - lookahead
    assert sorted(bm.key_of) == sorted(seq.block_table[:prompt_blocks]), "a block holding generated tokens was cached"
    again = Sequence("b", list(seq.token_ids) + [7], SamplingParams())
    assert bm.cached_prefix(again) == seq.block_table[:prompt_blocks]


def test_lru_eviction_only_when_the_pool_needs_it():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    a = computed(bm, list(range(13)))  # 4 blocks, 3 cached
    cached = a.block_table[:3]
    bm.free(a)
    assert bm.num_free_blocks == 6 and list(bm.evictable) == cached[::-1]  # the tail first
    b = computed(bm, [50, 51, 52, 53, 54], "b")  # 2 fresh blocks: the plain free ones, no eviction
    assert len(bm.block_of) == 3 + 1  # a's three and b's first
    c = Sequence("c", [60] * 9, SamplingParams())
    assert bm.allocate(c, [], 9)  # 3 blocks: the plain free one, then a's LRU tail blocks
    assert cached[0] in bm.block_of.values() and not {cached[1], cached[2]} & set(bm.block_of.values())
    assert bm.cached_prefix(Sequence("d", list(range(13)), SamplingParams())) == cached[:1]
    assert not bm.allocate(Sequence("e", [1] * 9, SamplingParams()), [], 9)  # all or nothing
    assert list(bm.evictable) == cached[:1] and bm.ref_counts.count(0) == 1
    bm.free(b)
    bm.free(c)
    stale = Sequence("f", [1], SamplingParams())
    stale.block_table = [cached[0]]
    with pytest.raises(RuntimeError, match=f"block {cached[0]} of f is freed but nobody holds it"):
        bm.free(stale)
    assert bm.num_free_blocks == 6


def test_a_hit_takes_a_reference_and_revives_cached_free_blocks():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = computed(bm, list(range(9)))
    b = computed(bm, list(range(9)) + [7], "b")  # shares a's two blocks while a runs
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    bm.free(a)
    bm.free(b)
    assert len(bm.evictable) == 2 and bm.num_free_blocks == 8
    c = computed(bm, list(range(9)), "c")
    assert c.num_cached_tokens == 8 and not bm.evictable and bm.num_hit_tokens == 16 and bm.num_query_tokens == 28


def test_caching_off_finds_nothing():
    bm = BlockManager(8, 4)
    computed(bm, list(range(9)))
    assert not bm.block_of and bm.cached_prefix(Sequence("b", list(range(9)), SamplingParams())) == []
    assert bm.num_query_tokens == bm.num_hit_tokens == 0


# ----------------------------------------------------------------------------- engine

def check_blocks(engine: LLMEngine) -> None:
    """free + used == total; every used block's reference count is its number of owners; no
    block twice in a table, free twice, or free and owned; cache maps consistent."""
    bm, scheduler = engine.block_manager, engine.scheduler
    owners = Counter(b for seq in scheduler.running for b in seq.block_table)
    assert all(len(set(seq.block_table)) == len(seq.block_table) for seq in scheduler.running)
    assert all(not seq.block_table for seq in scheduler.waiting)
    free = list(bm.free_blocks) + list(bm.evictable)
    assert len(set(free)) == len(free) and not set(free) & owners.keys()
    assert len(free) + len(owners) == bm.num_blocks == bm.num_free_blocks + len(owners)
    assert all(bm.ref_counts[b] == n for b, n in owners.items()) and not any(bm.ref_counts[b] for b in free)
    assert set(bm.evictable) <= bm.key_of.keys() and not set(bm.free_blocks) & bm.key_of.keys()
    assert {block: key for key, block in bm.block_of.items()} == bm.key_of


def prompt_kv(engine: LLMEngine, seq: SeqStep) -> dict[str, torch.Tensor]:
    """Every pool's (target's, draft's) KV at `seq`'s prompt positions, read through its block table."""
    positions = torch.arange(seq.num_prompt_tokens)
    blocks = torch.tensor(seq.block_table)[positions // B]
    gathered = {}
    for key, pool in engine.runner.kv_caches.items():
        axis = list(pool.shape).index(engine.runner.num_blocks + 1)  # then the block's slots
        gathered[key] = pool.movedim((axis, axis + 1), (0, 1))[blocks, positions % B].clone()
    return gathered


def record_steps(engine: LLMEngine) -> tuple[dict[str, list], dict[str, list]]:
    """Per request, for every step that sampled it: (accepted drafts, new tokens, next proposals),
    and the KV its prompt positions hold after the step."""
    steps: dict[str, list] = defaultdict(list)
    kv: dict[str, list] = defaultdict(list)
    launch, collect, launched = engine.runner.launch, engine.runner.collect, deque()

    def recorded_launch(batch):
        launch(batch)  # on CPU the step is done when launch returns: its KV is read now
        launched.append(batch)
        for item in batch.seqs:
            if item.samples:
                kv[item.request_id].append(prompt_kv(engine, item))

    def recorded_collect():
        results = collect()
        for item, result in zip(launched.popleft().seqs, results):
            if item.samples:
                steps[item.request_id].append((result.num_accepted, result.new_token_ids, result.draft_token_ids))
        return results

    engine.runner.launch, engine.runner.collect = recorded_launch, recorded_collect
    return steps, kv


def assert_same_kv(on: dict[str, list], off: dict[str, list]) -> None:
    """Cached KV equals the KV a request computes itself, up to fp32 rounding across batch shapes
    (a stale or overwritten entry is off by O(0.1))."""
    assert on.keys() == off.keys()
    for request_id in on:
        for step, (a, b) in enumerate(zip(on[request_id], off[request_id], strict=True)):
            for key in a:
                err = (a[key] - b[key]).abs().flatten(1).amax(1)
                bad = torch.nonzero(err >= 1e-4).flatten().tolist()
                assert not bad, f"{request_id}, step {step}: {key} differs at prompt positions {bad}"


def run_cases(target: str, caching: bool, **kwargs) -> tuple[dict, dict, dict, dict]:
    """The warm-up request alone, then CASES together: tokens, hits, steps and KV per request."""
    engine = LLMEngine(target, max_model_len=96, block_size=B, enable_prefix_caching=caching, **kwargs)
    steps, kv = record_steps(engine)
    engine.generate([WARM], GREEDY, use_tqdm=False)
    seqs, outputs = {}, {}
    for name, (prompt, _, _) in CASES.items():
        engine.add_request(prompt, GREEDY, request_id=name)
        seqs[name] = engine.requests[name].seq
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        check_blocks(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outputs, {name: seq.num_cached_tokens for name, seq in seqs.items()}, dict(steps), dict(kv)


@pytest.mark.parametrize("target,draft", [("llama", None), ("llama", "mha"), ("llama", "mla"), ("deepseek", "mla")])
def test_caching_on_and_off_agree_for_every_prefix_length(make_llama, make_deepseek, make_eagle3_llama, make_eagle3_mla,
                                                           target, draft):
    """Random full-vocabulary drafts: a stale or overwritten draft KV entry changes their proposals
    and always shows in the KV comparison. deepseek: the MLA target's latent cache."""
    path = make_llama() if target == "llama" else make_deepseek("v3")  # 2 and 3 layers: aux ids 0, 1, 2
    kwargs = {}
    if draft:
        make = make_eagle3_llama if draft == "mha" else make_eagle3_mla
        kwargs = dict(method="eagle3", draft_model=make(path, aux_layer_ids=[0, 1, 2]), num_speculative_tokens=3,
                      speculative_adaptive=False)  # k per step would follow the schedule, which caching changes
    off_tokens, off_hits, off_steps, off_kv = run_cases(path, False, **kwargs)
    on_tokens, on_hits, on_steps, on_kv = run_cases(path, True, **kwargs)
    assert on_tokens == off_tokens
    assert off_hits == dict.fromkeys(CASES, 0)
    assert on_hits == {name: hits[2 if draft else 1] for name, hits in CASES.items()}
    # the same accepted counts and proposals at every step, and the same KV under every prompt
    # position: cached blocks hold valid target and draft KV, and nobody overwrites them
    assert on_steps == off_steps
    assert_same_kv(on_kv, off_kv)


def mixed_workload(engine: LLMEngine) -> tuple[dict[str, tuple], dict[str, int]]:
    """Requests sharing prefixes of many lengths arrive over time into a pool too small for them
    (preemption, eviction), some end on stop strings or stop tokens, two are aborted (one
    running, one waiting). The block invariants are checked after every step and abort."""
    g = np.random.default_rng(5)
    bases = [other(40, 20), other(40, 21)]
    arrivals = []
    for i in range(10):
        base, shared = bases[i % 2], int(g.integers(0, 41))
        prompt = base[:shared] + other(int(g.integers(1, 10)), 100 + i)
        params = SamplingParams(temperature=0, max_tokens=int(g.integers(8, 20)), ignore_eos=True,
                                stop=["w7"] if i % 3 == 1 else None, stop_token_ids=[3, 5] if i % 3 == 2 else None)
        arrivals.append((i // 2, str(i), prompt, params))  # two a step
    aborts = {3: "3", 5: "9"}
    bm, outputs, evictions, step = engine.block_manager, {}, 0, 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, request_id, prompt, params = arrivals.pop(0)
            engine.add_request(None, params, request_id, prompt_ids=prompt)
        if step in aborts:
            engine.abort_request(aborts[step])
            check_blocks(engine)
        cached_before = len(bm.block_of)
        for out in engine.step():
            if out.finished and out.request_id not in aborts.values():
                outputs[out.request_id] = (out.token_ids, out.finish_reason)
        check_blocks(engine)
        evictions += len(bm.block_of) < cached_before  # keys go only when their block is evicted
        step += 1
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    return outputs, {"evictions": evictions, "preemptions": engine.scheduler.num_preemptions, "hits": bm.num_hit_tokens}


def test_no_leak_after_hits_evictions_preemption_aborts_and_stops(make_llama, make_eagle3_llama):
    target = make_llama(tokenizer=True)
    kwargs = dict(max_model_len=64, block_size=B, num_kv_blocks=10, method="eagle3",
                  draft_model=make_eagle3_llama(target, aux_layer_ids=[0, 1, 2]), num_speculative_tokens=2,
                  speculative_adaptive=False)
    off, _ = mixed_workload(LLMEngine(target, enable_prefix_caching=False, **kwargs))
    on, counts = mixed_workload(LLMEngine(target, **kwargs))
    assert on == off and len(on) == 8
    assert counts["evictions"] and counts["preemptions"] and counts["hits"], counts
    assert {reason for _, reason in on.values()} == {"stop", "length"}


def test_prompt_logprobs_score_every_position_even_when_the_prefix_is_cached(make_llama):
    """A request for prompt logprobs needs the forward over every prompt position, so it takes no
    cached blocks (the next request without them still does), and its numbers match caching off."""
    target = make_llama()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)

    def run(caching: bool):
        engine = LLMEngine(target, max_model_len=96, block_size=B, enable_prefix_caching=caching)
        engine.generate([BASE], GREEDY, use_tqdm=False)  # caches BASE's blocks
        out = engine.generate([BASE], params, use_tqdm=False)[0]
        hits_before = engine.block_manager.num_hit_tokens
        engine.generate([BASE], GREEDY, use_tqdm=False)
        return out, engine.block_manager.num_hit_tokens - hits_before

    (on, later_hits), (off, _) = run(True), run(False)
    assert later_hits == 32  # the cache is still used by requests that do not ask
    assert on.token_ids == off.token_ids and len(on.prompt_logprobs) == len(BASE)
    for a, b in zip(on.prompt_logprobs[1:], off.prompt_logprobs[1:], strict=True):
        assert a.token_id == b.token_id and list(a.top) == list(b.top)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


# ----------------------------------------------------------------------------- flag and metrics

def test_the_flag_has_an_off_form_in_both_spellings():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--model", "m"])).enable_prefix_caching is True
    for off in ("--no-enable-prefix-caching", "--no-enable_prefix_caching"):
        assert parser.parse_args(["--model", "m", off]).enable_prefix_caching is False
    assert parser.parse_args(["--model", "m", "--enable_prefix_caching"]).enable_prefix_caching is True
    assert parser.parse_args(["--model", "m"]).enforce_eager is False  # switches that default off stay switches
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--no-enforce-eager"])


def test_hit_rate_in_metrics_and_the_stats_line(caplog):
    metrics = ServerMetrics(0)
    state = EngineState(1, 0, 10, 16, 0, 0, 0, 0, [0], prefix_cache_queries=400, prefix_cache_hits=300)
    metrics.update(EngineState(0, 0, 16, 16, 0, 0, 0, 0, [0]))
    metrics.update(state)
    page = generate_latest(metrics.registry).decode()
    assert PrefixCacheSnapshot.parse(page) == PrefixCacheSnapshot(400, 300)
    assert "atom_like:prefix_cache_hit_rate 0.75" in page
    later = PrefixCacheSnapshot.parse(generate_latest(metrics.registry).decode())
    metrics.update(EngineState(1, 0, 10, 16, 0, 0, 0, 0, [0], prefix_cache_queries=500, prefix_cache_hits=300))
    window = PrefixCacheSnapshot.parse(generate_latest(metrics.registry).decode()).minus(later)
    assert (window.queries, window.hits, window.hit_rate) == (100, 0, 0.0)
    metrics.generated(5)
    logger = StatsLogger(metrics, interval=1e-9)
    with caplog.at_level("INFO", logger="atom_like.entrypoints.metrics"):
        logger.maybe_log(logger._last_time + 1.0, state)
    assert "prefix cache hit rate 75.0% (300/400 prompt tokens)" in caplog.text


def test_histogram_snapshot_reads_ttft_back():
    metrics = ServerMetrics(0)
    before = HistogramSnapshot.parse(generate_latest(metrics.registry).decode(), "time_to_first_token_seconds")
    for seconds in [0.015] * 50 + [0.03] * 49 + [3.0]:
        metrics.first_token(seconds, 10)
    after = HistogramSnapshot.parse(generate_latest(metrics.registry).decode(), "time_to_first_token_seconds")
    ttft = after.minus(before)
    assert ttft.count == 100 and ttft.mean == pytest.approx((50 * 0.015 + 49 * 0.03 + 3.0) / 100)
    assert 0.01 < ttft.quantile(0.5) <= 0.02 < ttft.quantile(0.9) <= 0.04 and 2.5 < ttft.quantile(0.995) <= 5.0
