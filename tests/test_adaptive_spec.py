"""Speculation with the draft count k chosen per step (0..num_speculative_tokens, spec_decode/adaptive.py):
greedy output identical to no speculation while k switches every step (0 included), on the MHA
and MLA drafts, overlapped and not, eager and through the static decode path; statistics equal a
hand count; the policy's arithmetic, its lag, its probes and its cost cache.

Costs (2 shared cores): the policy tests are instant; each engine test builds tiny fp32 models
(a few seconds each); the whole file ~1-2 min."""
from __future__ import annotations

import numpy as np
import pytest

from oracle_proposer import OracleProposer, accept_first

from atom_like import LLMEngine, SamplingParams
from spec_decode.adaptive import AcceptanceTracker, AdaptiveDraftLength, DraftLengthPolicy, FixedDraftLength
from spec_decode.step_costs import StepClock, StepCosts, StepTimes

rng = np.random.default_rng(5)
PROMPTS = [[int(x) for x in rng.integers(0, 128, n)] for n in (3, 21, 9)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PATTERN = (0, 3, 1, 5, 0, 0, 2, 4, 1, 5, 3)  # k per step: switches every step, 0 twice in a row, up to 5 > 3


class Cycle(DraftLengthPolicy):
    """k = pattern[step % len]: a forced pattern, and a log of what was chosen and observed."""

    def __init__(self, pattern, max_drafts):
        self.pattern, self.max_drafts = pattern, max_drafts
        self.chosen, self.observed = [], []

    def choose(self, step, num_seqs):
        self.chosen.append(self.pattern[step % len(self.pattern)])
        return self.chosen[-1]

    def observe(self, step, drafted, accepted):
        self.observed += [(step, d, a) for d, a in zip(drafted, accepted)]


def generate(engine, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def assert_no_leak(engine):
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def llama(make_llama):
    path = make_llama(num_hidden_layers=4, seed=2)
    return path, generate(LLMEngine(path, max_model_len=128))


# ----------------------------------------------------------------------------- lossless while k switches

def watch_static_path(engine) -> list[tuple[int, int, bool]]:
    """(drafts verified, drafts proposed, replayed from the static buffers) of every pure decode step."""
    graphs, seen = engine.runner.graphs, []
    eligible = graphs.eligible

    def watched(batch):
        ok = eligible(batch)
        if all(s.samples and len(s.token_ids) == 1 for s in batch.seqs):
            seen.append((len(batch.seqs[0].spec_token_ids), batch.num_drafts, ok))
        return ok

    graphs.eligible = watched
    return seen


@pytest.mark.parametrize("overlap,eager", [(True, False), (False, False), (True, True)])
def test_switching_k_is_lossless_mha(llama, make_eagle3_llama, overlap, eager):
    """Through the static path (speculative_adaptive captures every k), every pure decode step is
    replayed, the steps that return from k = 0 included (verify 0 drafts, propose k > 0): on a GPU
    an eager one costs a whole step's kernel launches."""
    path, baseline = llama
    engine = LLMEngine(path, max_model_len=128, method="eagle3", draft_model=make_eagle3_llama(path, aux_layer_ids=[0, 1, 2]),
                       num_speculative_tokens=5, overlap_scheduling=overlap, enforce_eager=eager,
                       speculative_adaptive=True)
    engine.draft_policy = policy = Cycle(PATTERN, 5)
    decode_steps = [] if eager else watch_static_path(engine)
    assert generate(engine) == baseline
    assert set(policy.chosen) == set(PATTERN)
    assert {d for _, d, _ in policy.observed} == set(PATTERN) - {0}  # every k > 0 was verified
    if not eager:
        assert all(ok for _, _, ok in decode_steps), decode_steps
        assert {(v, k) for v, k, _ in decode_steps} >= {(0, 3), (0, 2), (5, 0), (3, 1)}
    assert_no_leak(engine)


def test_switching_k_reuses_the_sampling_rows(llama, make_eagle3_llama, monkeypatch):
    """A sampling batch whose k alternates builds each k's per-row sampling settings once (they
    were rebuilt and uploaded at every change of k)."""
    import atom_like.engine.sampler as sampler_module

    path, _ = llama
    engine = LLMEngine(path, max_model_len=128, method="eagle3", draft_model=make_eagle3_llama(path, aux_layer_ids=[0, 1, 2]),
                       num_speculative_tokens=3, speculative_adaptive=True)
    engine.draft_policy = Cycle([1, 3], 3)
    built = []
    build = sampler_module.row_sampling_tensors
    monkeypatch.setattr(sampler_module, "row_sampling_tensors", lambda *a: built.append(tuple(a[2])) or build(*a))
    # unseeded: a seeded sampling request pins k to its maximum (LLMEngine._num_drafts)
    outs = engine.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].token_ids) == 24
    assert {(2,), (4,)} <= set(built) and len(built) <= 4, built  # prefill, first verify, then k = 1 and 3 once each
    assert_no_leak(engine)


def test_switching_k_is_lossless_mla(make_deepseek, make_eagle3_mla):
    """MLA target and draft, overlapped through the static path vs synchronous and eager: the same
    tokens as without a draft, and the same proposals step for step (a wrong first-pass width,
    chain or row layout shows there even where verification keeps the tokens right)."""
    target = make_deepseek(arch="v3")
    prompts, params = PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)  # the MoE target is slow
    baseline = generate(LLMEngine(target, max_model_len=64), prompts, params)
    draft = make_eagle3_mla(target, aux_layer_ids=(0, 1, 2))
    proposals = []
    for overlap, eager in ((True, False), (False, True)):
        engine = LLMEngine(target, max_model_len=64, method="eagle3", draft_model=draft, num_speculative_tokens=5,
                           overlap_scheduling=overlap, enforce_eager=eager, speculative_adaptive=True)
        engine.draft_policy = policy = Cycle(PATTERN, 5)
        decode_steps = [] if eager else watch_static_path(engine)
        seen, collect = [], engine.runner.collect
        engine.runner.collect = lambda: seen.append(collect()) or seen[-1]
        assert generate(engine, prompts, params) == baseline
        assert {d for _, d, _ in policy.observed} >= {1, 3, 5}
        assert all(ok for _, _, ok in decode_steps), decode_steps  # the static path, every k (0 -> k > 0 included)
        assert_no_leak(engine)
        proposals.append([[r.draft_token_ids for r in results] for results in seen[:12]])  # before any zombie step
    assert proposals[0] == proposals[1]
    assert {len(d) for step in proposals[0] for d in step} >= {0, 1, 2, 3, 4, 5}


def oracle_engine(path, baseline, k, corrupt, **kwargs):
    continuations = {str(i): toks for i, toks in enumerate(baseline)}
    return LLMEngine(path, max_model_len=128, **kwargs,
                     proposer_factory=lambda runner: OracleProposer(runner, continuations, k, corrupt))


def run(engine, prompts, params):
    ids = [engine.add_request(p, params, request_id=str(i)) for i, p in enumerate(prompts)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


@pytest.mark.parametrize("overlap", [True, False])
def test_stats_equal_a_hand_count(llama, overlap):
    """One request, drafts accepted up to position m, k from the pattern: every count by hand."""
    path, baseline = llama
    k, m, max_tokens = 5, 2, 22
    engine = oracle_engine(path, baseline, k, accept_first(m), overlap_scheduling=overlap)
    engine.draft_policy = Cycle(PATTERN, k)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    assert run(engine, PROMPTS[:1], params) == [baseline[0][:max_tokens]]

    drafts = draft_tokens = accepted_total = 0
    accepted, drafted, hist = [0] * k, [0] * k, [0] * (k + 1)
    generated, step = 1, 1  # step 0 prefilled and sampled one token; step s verifies what step s - 1 proposed
    while generated < max_tokens:
        d = PATTERN[(step - 1) % len(PATTERN)]
        a = min(m, d)
        if d:
            drafts, draft_tokens, accepted_total = drafts + 1, draft_tokens + d, accepted_total + a
            hist[a] += 1
            for i in range(d):
                drafted[i] += 1
                accepted[i] += i < a
        generated += a + 1
        step += 1
    s = engine.spec_stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (drafts, draft_tokens, accepted_total)
    assert (s.accepted_per_position, s.drafted_per_position, s.accepted_histogram) == (accepted, drafted, hist)
    assert s.per_position_acceptance == [x / y if y else 0.0 for x, y in zip(accepted, drafted)]
    assert s.per_position_acceptance[:m] == [1.0] * m and s.per_position_acceptance[m] == 0.0
    stats = engine.stats()
    assert stats.num_drafts_in_use in PATTERN and list(stats.drafted_per_position) == drafted
    assert_no_leak(engine)


def test_metrics_show_k_and_exact_per_position_rates():
    from atom_like.entrypoints.metrics import EngineState, ServerMetrics, SpecSnapshot
    from prometheus_client import generate_latest

    metrics = ServerMetrics(3)
    # 4 drafts: k = 3, 1, 0 (not a draft), 2 with 2, 1, -, 0 accepted: histogram [1, 1, 1, 0]
    state = EngineState(1, 0, 10, 16, 0, 3, 6, 3, [1, 1, 1, 0], drafted_per_position=[3, 2, 1], num_drafts_in_use=2)
    metrics.update(state)
    page = generate_latest(metrics.registry).decode()
    assert "atom_like:spec_decode_draft_tokens_in_use 2.0" in page
    back = SpecSnapshot.parse(page)
    assert back.drafted_per_position == [3, 2, 1] and back.num_drafts_in_use == 2
    assert back.per_position_acceptance == pytest.approx([2 / 3, 1 / 2, 0.0])
    assert "k now 2 (mean 2.00, at most 3)" in back.describe()


# ----------------------------------------------------------------------------- the policy

def test_tracker_arithmetic():
    t = AcceptanceTracker(3, decay=0.5, prior=0.6, prior_weight=1.0)
    t.end_step([3, 2, 1], [1, 2, 0])  # reached: pos0 3, pos1 2, pos2 0; accepted: pos0 2, pos1 1
    assert t.reached == [3, 2, 0] and t.accepted == [2, 1, 0]
    a0 = (2 + 0.6) / 4
    a1 = (1 + a0) / 3
    assert t.rates() == pytest.approx([a0, a1, a1])  # position 2: no evidence, follows position 1
    assert t.expected_accepted() == pytest.approx([0, a0, a0 + a0 * a1, a0 + a0 * a1 + a0 * a1 * a1])
    t.end_step([], [])
    assert t.reached == [1.5, 1.0, 0.0]
    t.end_step([3, 3, 3, 2], [3, 0, 2, 1])  # all accepted; none; two of three; one of two
    assert t.reached == [0.75 + 4, 0.5 + 3, 0.0 + 2] and t.accepted == [0.5 + 3, 0.25 + 2, 0.0 + 1]


@pytest.mark.parametrize("batch", [2, 40], ids=["python_histograms", "numpy_histograms"])
def test_tracker_merges_many_steps_in_one_pass(batch):
    """end_steps (the policy's merge of the steps since its last choice) against a per-sequence,
    per-position count decayed step by step: gaps without verifications, ragged drafts, both
    histogram paths."""
    rng = np.random.default_rng(batch)
    decay = 0.9
    tracker, reached, hits = AcceptanceTracker(5, decay=decay), [0.0] * 5, [0.0] * 5
    for _ in range(6):
        steps = int(rng.integers(1, 9))
        verified = []
        for j in sorted(rng.choice(steps, size=int(rng.integers(0, steps + 1)), replace=False).tolist()):
            drafted = rng.integers(1, 6, size=batch).tolist()
            verified.append((j, drafted, [int(rng.integers(0, d + 1)) for d in drafted]))
        tracker.end_steps(steps, verified)
        by_step = dict((j, (d, a)) for j, d, a in verified)
        for j in range(steps):
            reached, hits = [x * decay for x in reached], [x * decay for x in hits]
            for d, a in zip(*by_step.get(j, ([], []))):
                for i in range(d):
                    reached[i] += i <= a  # position i is reached when the i before it were accepted
                    hits[i] += i < a
        assert tracker.reached == pytest.approx(reached, rel=1e-12)
        assert tracker.accepted == pytest.approx(hits, rel=1e-12)
    assert min(reached) > 0 and hits != reached  # the case is not trivial


def forced_run(m, steps=200, num_seqs=8, k=5):
    """The policy against verification that accepts exactly min(m, drafted): the k it settles on."""
    policy = AdaptiveDraftLength(k, StepCosts.fixed([1, 8, 64], k))
    chosen = []
    for step in range(steps):
        chosen.append(policy.choose(step, num_seqs))
        if step and chosen[step - 1]:  # what step - 1 proposed is verified now, and seen a step later
            policy.observe(step, [chosen[step - 1]] * num_seqs, [min(m, chosen[step - 1])] * num_seqs)
    return chosen


@pytest.mark.parametrize("m", [1, 2, 4, 5])
def test_policy_settles_on_the_forced_length(m):
    chosen = forced_run(m)
    # the rest: probes of position m (its evidence decays toward position m - 1's), 3 steps each (the lag)
    assert chosen[100:].count(m) >= 90, chosen


def test_policy_stops_drafting_and_probes_when_nothing_is_accepted():
    chosen = forced_run(0, steps=400)
    starts = [s for s in range(50, 400) if chosen[s] and not chosen[s - 1]]
    # a k = 1 probe every few tens of steps (HOLD steps long: a choice holds that long; the 2-step lag is
    # shorter), the rest plain decoding
    probe = max(3, AdaptiveDraftLength.HOLD)
    assert 2 <= len(starts) <= 8 and sum(map(bool, chosen[50:])) <= probe * len(starts) and max(chosen[50:]) == 1, chosen


def test_probes_that_find_nothing_come_ever_more_rarely():
    """Every probe costs a few steps of drafts (SmolLM2 pair at batch 1, T = 1 on an H100: 9.5% of steps
    drafted, 0.95-0.96x no speculation where every fixed k lost 17-23%). After each probe that finds
    nothing the policy waits twice as long for the next, up to MAX_QUIET steps; once drafts pay
    again it drafts within that wait, and a run of drafts resets it."""
    policy = AdaptiveDraftLength(5, StepCosts.fixed([8], 5))
    chosen, accept = [], 0
    for step in range(3000):
        if step == 2500:
            accept = 5  # acceptance returns
        chosen.append(policy.choose(step, 8))
        if step and chosen[step - 1]:
            policy.observe(step, [chosen[step - 1]] * 8, [min(accept, chosen[step - 1])] * 8)
    starts = [s for s in range(1, 2500) if chosen[s] and not chosen[s - 1]]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert all(b >= a for a, b in zip(gaps[1:], gaps[2:])), gaps  # the waits grow ...
    assert max(gaps) <= AdaptiveDraftLength.MAX_QUIET + 3 * AdaptiveDraftLength.HOLD and len(starts) <= 16, gaps
    assert sum(map(bool, chosen[1000:2500])) <= 4 * AdaptiveDraftLength.HOLD * 1500 / AdaptiveDraftLength.MAX_QUIET
    resumed = next(s for s in range(2500, 3000) if chosen[s] >= 4)
    assert resumed - 2500 <= AdaptiveDraftLength.MAX_QUIET + 4 * AdaptiveDraftLength.HOLD, resumed
    assert min(chosen[resumed + 20:]) >= 4  # ... and drafting stays once it pays


def test_a_choice_holds_for_hold_steps_of_one_bucket():
    """Worked out afresh every HOLD steps, or at once when the batch moves to another bucket; held
    in between, whatever was observed meanwhile."""
    hold = AdaptiveDraftLength.HOLD
    policy = AdaptiveDraftLength(3, StepCosts.fixed([8, 64], 3))
    assert policy.choose(0, 8) == 3  # the prior: speculate
    for step in range(1, hold):
        policy.observe(step - 1, [3] * 8, [0] * 8)  # nothing accepted
        assert policy.choose(step, 8) == 3
    assert policy.choose(hold, 8) == 0 and policy.tracker.reached[0] > 0
    fresh = AdaptiveDraftLength(3, StepCosts.fixed([8, 64], 3))
    assert fresh.choose(0, 8) == 3
    fresh.observe(0, [3] * 8, [0] * 8)
    assert fresh.choose(2, 40) == 0  # another bucket: step 0's verification merged, k worked out again


def test_policy_uses_only_steps_two_back():
    """choose(N) sees steps <= N - 2, with or without overlap: step N - 1 may still be in flight."""
    hold = AdaptiveDraftLength.HOLD  # choices worked out afresh at steps 0, hold, 2 * hold ...
    policy = AdaptiveDraftLength(3, StepCosts.fixed([8], 3))
    assert policy.choose(0, 8) == 3  # the prior: speculate
    policy.observe(2 * hold - 2, [3] * 8, [0] * 8)
    policy.observe(2 * hold - 1, [3] * 4, [3] * 4)
    assert policy.choose(hold, 8) == 3 and policy.tracker.reached == [0, 0, 0]
    # step 2 * hold - 2 merged (8 drafts, none accepted), step 2 * hold - 1 not (4 drafts, all accepted)
    assert policy.choose(2 * hold, 8) == 0 and policy.tracker.reached == [8, 0, 0]


def test_host_bound_steps_are_priced_by_their_periods():
    """Device times that grow with k, a host that takes longer than any of them: the policy moves
    from the device-priced k to k = 0 (below every priced k: its device time), then to the k that
    the host-bound prices, moved by the profile's differences, say pays, then back to k = 1 once
    that k turns out to cost the host more."""
    costs = StepCosts([1], [[0.3e-3, 0.4e-3, 0.5e-3, 0.6e-3, 0.7e-3, 0.8e-3]], "measured on d")
    policy = AdaptiveDraftLength(5, costs, AcceptanceTracker(5, prior=0.5, prior_weight=1.0))
    later = 300  # past any choice's hold (HOLD steps, a k = 0 choice up to MAX_QUIET)
    assert policy.choose(0, 1) == 1  # device time alone: a = 0.5 pays for one draft
    for _ in range(3):
        policy.observe_step(1, 1, 1.5e-3)
    assert policy.step_times(1)[4] == pytest.approx(1.8e-3)  # k = 1's period and the profile's 0.3 ms more
    assert policy.step_times(1)[0] == 0.3e-3 and policy.choose(later, 1) == 0  # below every priced k: device time
    for _ in range(3):
        policy.observe_step(1, 0, 1.5e-3)
    assert policy.choose(2 * later, 1) == 3  # host-bound: k = 3 at 1.7 ms gains 0.875 tokens
    for _ in range(3):
        policy.observe_step(1, 3, 3.1e-3)  # ... until k = 3 turns out to cost the host 0.8 ms a draft
    assert policy.step_times(1)[2] == pytest.approx(2.3e-3)  # between k = 1 and 3
    assert policy.step_times(1)[4] == pytest.approx(3.2e-3)  # above: k = 3's and the profile's 0.1 ms
    assert policy.choose(3 * later, 1) == 1
    fixed = AdaptiveDraftLength(5, StepCosts.fixed([1], 5), AcceptanceTracker(5, prior=0.5, prior_weight=1.0))
    for _ in range(3):
        fixed.observe_step(1, 1, 200.0)
    assert fixed.step_times(1)[1] == StepCosts.fixed([1], 5).step_times(1)[1]  # the table's units are not seconds


def test_a_k_below_every_priced_one_is_tried():
    """Batch 32, temperature 1 on an H100 (2026-11-27): k = 1 priced 3.73 ms and k = 3 3.07 ms (noise
    and drift), acceptance ~0.2 a position. Extrapolated down their slope, k = 0 would cost 4.06 ms and
    never be run, though it was the best mode (2.27 ms). Unpriced below the lowest priced k, it costs
    its device time, so the policy runs it, and its price then decides."""
    costs = StepCosts([32], [[0.8e-3, 0.9e-3, 1.0e-3, 1.1e-3, 1.2e-3, 1.3e-3]], "measured on d")
    policy = AdaptiveDraftLength(5, costs, AcceptanceTracker(5, prior=0.2, prior_weight=1e6))
    for k, host in ((1, 3.73e-3), (3, 3.07e-3), (4, 3.79e-3), (5, 3.87e-3)):
        for _ in range(3):
            policy.observe_step(32, k, host)
    hold = policy.HOLD  # a choice is worked out afresh every HOLD steps
    assert policy.step_times(32)[0] == 0.8e-3 and policy.choose(0, 32) == 0
    for _ in range(3):
        policy.observe_step(32, 0, 2.27e-3)
    assert policy.step_times(32)[0] == 2.27e-3 and policy.choose(hold, 32) == 0  # 1 / 2.27 beats 1.25 / 3.07
    for _ in range(10):  # had k = 0 been dear (three quarters of its samples), its price would have said so
        policy.observe_step(32, 0, 4.5e-3)
    assert policy.choose(2 * hold, 32) == 3


def test_adaptive_engine_is_lossless_and_follows_acceptance(llama):
    """The real policy in the engine (CPU: the fixed cost table): all drafts accepted -> k stays
    high; none -> k drops to 0 after the first verifications; the tokens never change."""
    path, _ = llama
    # long enough for steady steps at k = 5 (6 tokens a step): the step clock's samples need 3 in a row
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    baseline = generate(LLMEngine(path, max_model_len=128), params=params)
    for m, expect in ((5, 5), (0, 0)):
        engine = oracle_engine(path, baseline, 5, accept_first(m))
        engine.draft_policy = policy = AdaptiveDraftLength(5, engine.runner.step_costs)
        chosen = []
        choose = policy.choose
        policy.choose = lambda step, n: chosen.append(choose(step, n)) or chosen[-1]
        assert run(engine, PROMPTS, params) == baseline
        assert chosen[-1] == expect, chosen
        assert_no_leak(engine)
        # the engine timed its steady decode steps for the policy, at the ks it ran
        seen = policy.times.observed(len(PROMPTS))
        assert expect in seen and all(t > 0 for t in seen.values()), seen


def test_adaptive_is_opt_in_with_eagle3(llama, make_eagle3_llama):
    """Off by default until it beats the best fixed k on real acceptance (docs/benchmarks.md 11)."""
    path, _ = llama
    draft = make_eagle3_llama(path, aux_layer_ids=[0, 1, 2])
    on = LLMEngine(path, max_model_len=128, method="eagle3", draft_model=draft, num_speculative_tokens=8,
                   speculative_adaptive=True)
    assert isinstance(on.draft_policy, AdaptiveDraftLength) and on.draft_policy.max_drafts == 8
    off = LLMEngine(path, max_model_len=128, method="eagle3", draft_model=draft)
    assert type(off.draft_policy).__name__ == "FixedDraftLength"
    with pytest.raises(ValueError, match=r"num-speculative-tokens must be in 1\.\.8; got 9"):
        LLMEngine(path, method="eagle3", draft_model=draft, num_speculative_tokens=9)


@pytest.mark.parametrize("drafter", ["mha", "mla"])
def test_k8_past_65535_blocks_on_triton(make_llama, make_deepseek, make_eagle3_llama, make_eagle3_mla, drafter):
    """k up to 8 (verify width 9) through the Triton kernels (interpreter) with every block id
    >= 65,600: MHA draft on a Llama target, MLA draft on a DeepSeek-V3 target."""
    if drafter == "mha":
        target = make_llama(num_hidden_layers=2, seed=3)
        draft = make_eagle3_llama(target, aux_layer_ids=[0, 1, 2])
    else:
        target = make_deepseek(arch="v3")
        draft = make_eagle3_mla(target, aux_layer_ids=(0, 1, 2))
    prompts, params = PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    kwargs = dict(max_model_len=48, block_size=2, num_kv_blocks=70_000, attention_backend="triton", enforce_eager=True)
    baseline = generate(LLMEngine(target, **kwargs), prompts, params)
    engine = LLMEngine(target, method="eagle3", draft_model=draft, num_speculative_tokens=8, **kwargs)
    engine.draft_policy = policy = Cycle((8, 0, 6, 8, 4), 8)
    engine.block_manager.free_blocks.rotate(-65_600)  # hand out ids >= 65,600 first
    assert generate(engine, prompts, params) == baseline
    assert {d for _, d, _ in policy.observed} >= {8, 6}
    engine.block_manager.free_blocks.rotate(65_600)
    assert_no_leak(engine)


def test_a_seeded_sampling_request_pins_k(llama, make_eagle3_llama):
    """Its draws depend on the drafts each step verifies: while it runs every step proposes the
    full k, so its tokens are the same alone and next to others, whatever the policy says."""
    path, _ = llama
    draft = make_eagle3_llama(path, aux_layer_ids=[0, 1, 2])
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True)
    outs = []
    for pattern, prompts, params in (((0, 3, 1), PROMPTS[:1], seeded), ((2, 0, 5, 4), PROMPTS, [seeded, GREEDY, GREEDY])):
        engine = LLMEngine(path, max_model_len=128, method="eagle3", draft_model=draft, num_speculative_tokens=5)
        engine.draft_policy = Cycle(pattern, 5)
        outs.append(engine.generate(prompts, params, use_tqdm=False)[0].token_ids)
    assert outs[0] == outs[1]


def test_adaptive_steps_read_nothing_back(llama, make_eagle3_llama):
    """With the real policy choosing k (here dropping from its prior towards 0 and probing back:
    a random draft), neither a launch nor the choice of k reads a device value: the host never
    waits for the device before the step's collect (each read is a synchronisation on a GPU)."""
    from test_overlap import no_device_reads

    path, baseline = llama
    engine = LLMEngine(path, max_model_len=128, method="eagle3", draft_model=make_eagle3_llama(path, aux_layer_ids=[0, 1, 2]),
                       num_speculative_tokens=3, speculative_adaptive=True)
    runner, policy = engine.runner, engine.draft_policy
    networks = [runner.model, runner.proposer.draft]
    launch, choose, chosen = runner.launch, policy.choose, []

    def checked_launch(batch):
        with no_device_reads(networks):
            launch(batch)

    def checked_choose(step, num_seqs):
        with no_device_reads([]):
            chosen.append(choose(step, num_seqs))
        return chosen[-1]

    runner.launch, policy.choose = checked_launch, checked_choose
    assert generate(engine) == baseline
    assert len(set(chosen)) > 1, chosen


def _simulate(policy_for, monkeypatch, device_ms, host_ms, accept, steps=600, batch=1, noise=0.2, seed=0,
              context_ms=0.0):
    """tokens/s of a policy on a modelled machine, its calls timed by the engine's StepClock: call N
    takes max(device_ms(k) + context_ms, host) with host = host_ms(k, k of the step before (whose
    drafts this launch verifies), tokens of the step it collects), noisy (lognormal), as on an
    overlapped pipeline; each of `batch` sequences accepts every draft with probability `accept`,
    seen by the policy with the engine's lag. The start-up profile is device_ms alone: context_ms is
    what long contexts add to every k, which it does not see."""
    rng = np.random.default_rng(seed)
    now = [0.0]
    monkeypatch.setattr("spec_decode.step_costs.time.perf_counter", lambda: now[0])
    policy = policy_for(StepCosts([batch], [[device_ms(k) * 1e-3 for k in range(6)]], "measured on a model"))
    clock, ks, accepted, tokens, seconds = StepClock(), [0], [0] * batch, 0, 0.0
    for step in range(steps):
        clock.begin()
        k = policy.choose(step, batch)
        host = host_ms(k, ks[-1], batch + sum(accepted)) * 1e-3 * rng.lognormal(0.0, noise)
        period = max((device_ms(k) + context_ms) * 1e-3, host)
        now[0] += period
        sample = clock.end((batch, k))
        if sample is not None:
            policy.observe_step(*sample)
        accepted = [0] * batch  # the step launched now verifies what the one before proposed
        for i in range(batch):
            while accepted[i] < ks[-1] and rng.random() < accept:
                accepted[i] += 1
        if ks[-1]:
            policy.observe(step, [ks[-1]] * batch, accepted)
        ks.append(k)
        if step >= steps // 5:  # after a warm-up, as the benchmark's windows
            tokens, seconds = tokens + batch + sum(accepted), seconds + period
    return tokens / seconds


@pytest.mark.parametrize("name, device_ms, host_ms, accept", [
    # SmolLM2-135M at batch 1 on an H100: host-bound, every k about 1.55 ms (section 11)
    ("host-bound, flat", lambda k: 0.35 + 0.1 * k, lambda k, *_: 1.50 + 0.02 * k, 0.5),
    # large batch of a small model: the host's own cost grows with k (fixed k = 1 beat k = 5 by 1.4x)
    ("host-bound, growing", lambda k: 2.0 + 0.5 * k, lambda k, *_: 8.0 + 2.5 * k, 0.3),
    # the 8B shape: device-bound, the host well below the device
    ("device-bound", lambda k: 5.9 + 0.9 * k, lambda k, *_: 1.0 + 0.05 * k, 0.8),
    ("device-bound, nothing accepted", lambda k: 5.9 + 0.9 * k, lambda k, *_: 1.0 + 0.05 * k, 0.0),
    # host and device close: host-bound at small k, device-bound from k = 3
    ("mixed", lambda k: 1.0 + 0.4 * k, lambda k, *_: 1.8 + 0.1 * k, 0.7),
])
def test_adaptive_on_a_modelled_machine_stays_near_the_best_fixed_k(monkeypatch, name, device_ms, host_ms, accept):
    """Not a benchmark (the GPU's is docs/benchmarks.md section 11): the policy's choices on a
    model of the machines measured there, with 20% noise on every host sample. Adaptive within
    10% of the best fixed k and never below 0.95x no speculation."""
    adaptive = _simulate(lambda costs: AdaptiveDraftLength(5, costs), monkeypatch, device_ms, host_ms, accept)
    fixed = [_simulate(lambda costs: FixedDraftLength(k), monkeypatch, device_ms, host_ms, accept) for k in range(6)]
    assert adaptive >= 0.90 * max(fixed) and adaptive >= 0.95 * fixed[0], (name, adaptive, fixed)


@pytest.mark.parametrize("seed", [0, 2])
def test_prices_after_a_change_of_k_are_not_the_old_ks(monkeypatch, seed):
    """A host-bound batch with little accepted (k = 0 is best): each probe at a larger k is followed
    by k = 0 calls that still verify the probe's drafts and emit its tokens. Priced by those calls,
    k = 0 looked dearer than it is and the policy kept probing (0.943x / 0.953x no speculation at
    seeds 0 / 2 with samples taken as soon as the next launch kept the k); with samples only after
    three launches at one k, 1.001x / 0.994x (seeds 0-3: 0.943-0.981x before, 0.989-1.001x now)."""
    device_ms = lambda k: 1.0 + 0.15 * k
    host_ms = lambda k, k_before, collected: 1.5 + 0.1 * k + 0.25 * k_before + 0.02 * collected
    run = lambda policy_for: _simulate(policy_for, monkeypatch, device_ms, host_ms, 0.15, steps=800, batch=32, noise=0.1,
                                       seed=seed)
    adaptive, plain = run(lambda costs: AdaptiveDraftLength(5, costs)), run(lambda costs: FixedDraftLength(0))
    assert adaptive >= 0.975 * plain, (adaptive, plain)


def test_k0_priced_in_a_slow_phase_is_priced_again():
    """k = 0's price taken in a slow phase of the host (all its last samples), the drafting ks' from
    before it, and drafting that does not pay at the real costs: drafting then looks cheaper, and while
    it runs k = 0 never ran again to correct its price (the zoo's batch-1, T = 1 lock-in, 564 steps at
    k = 3; docs/benchmarks.md section 11). After REPRICE_AFTER samples of other ks the policy runs k = 0
    afresh and stays there."""
    fast = [1.5e-3, 1.95e-3, 2.0e-3, 2.05e-3, 2.1e-3, 2.15e-3]  # host-bound: drafting costs 0.45 ms and up
    policy = AdaptiveDraftLength(5, StepCosts([8], [[0.4e-3 + 0.1e-3 * k for k in range(6)]], "measured on d"))
    for k in range(1, 6):
        for _ in range(3):
            policy.observe_step(8, k, fast[k])
    for _ in range(StepTimes.WINDOW):
        policy.observe_step(8, 0, 1.8 * fast[0])  # the slow phase
    chosen = []
    for step in range(1200):
        chosen.append(policy.choose(step, 8))
        if step and chosen[-2]:  # one of 8 sequences accepts a draft: rate(1) = 1.125 / 1.95 ms < 1 / 1.5 ms
            policy.observe(step, [chosen[-2]] * 8, [1] + [0] * 7)
        policy.observe_step(8, chosen[-1], fast[chosen[-1]])
    assert chosen[1] > 0  # drafting looked cheaper than k = 0's slow-phase price
    assert chosen[-300:].count(0) >= 290, chosen[-300:]


def test_long_contexts_move_the_best_k_and_the_prices_follow(monkeypatch):
    """The 8B shape at batch 128 on an H100 (2026-11-27): the start-up profile says 17.8 ms at k = 4
    and 22.8 at k = 5, so with every draft accepted k = 4 looks best (5 / 17.8 > 6 / 22.8); at
    ~2k-token contexts every k took ~10 ms more, and k = 5 was best (6 / 32.8 > 5 / 27.8). The
    profile alone stays at k = 4; a priced k moved by the profile's differences finds k = 5."""
    profile = [6.9, 8.7, 12.0, 14.6, 17.8, 22.8]
    device_ms, host_ms = (lambda k: profile[k]), (lambda k, *_: 6.0 + 0.3 * k)
    run = lambda policy_for: _simulate(policy_for, monkeypatch, device_ms, host_ms, 1.0, batch=128, context_ms=10.0,
                                       noise=0.05)
    fixed = [run(lambda costs: FixedDraftLength(k)) for k in range(6)]
    assert max(range(6), key=fixed.__getitem__) == 5
    policy = []
    adaptive = run(lambda costs: policy.append(AdaptiveDraftLength(5, costs)) or policy[0])
    assert adaptive >= 0.99 * fixed[5], (adaptive, fixed)
    assert policy[0].choose(600 + AdaptiveDraftLength.HOLD, 128) == 5  # past the simulated 600 and the choice they held
    fresh = AdaptiveDraftLength(5, StepCosts([128], [[t * 1e-3 for t in profile]], "measured on d"),
                                AcceptanceTracker(5, prior=1.0, prior_weight=1e6))
    assert fresh.choose(0, 128) == 4  # the profile alone
    for k in range(5):  # the lower ks tried too (below every priced k, each looked its device time)
        for _ in range(3):
            fresh.observe_step(128, k, profile[k] * 1e-3 + 10e-3)
    assert fresh.step_times(128)[5] == pytest.approx(32.8e-3)  # k = 4's period and the profile's 5 ms
    assert fresh.choose(AdaptiveDraftLength.HOLD, 128) == 5


def test_a_dear_first_draft_does_not_hide_the_longer_ones():
    """The SmolLM2 pair at batch 128, T = 0 on an H100 (2026-11-27): k = 0 took 5.3 ms a step, k = 1
    8.5 and k = 4 9.0 (the profile, at the shortest context: 0.9, 1.1 and 1.6 ms). Extrapolated
    along the slope of k = 0 and 1, k = 4 looked 18 ms, and the policy drafted 1 every step where
    fixed k = 4 was 1.08x faster (0.92x it). Moved from k = 1 by the profile's differences, k = 2-5
    cost 8.7-9.3 ms, and k = 3 pays best at this acceptance."""
    profile = [0.885e-3, 1.051e-3, 1.234e-3, 1.401e-3, 1.630e-3, 1.829e-3]
    policy = AdaptiveDraftLength(5, StepCosts([128], [profile], "measured on d"),
                                 AcceptanceTracker(5, prior=0.45, prior_weight=1e6))
    for k, period in ((0, 5.33e-3), (1, 8.5e-3)):
        for _ in range(3):
            policy.observe_step(128, k, period)
    assert policy.step_times(128)[4] == pytest.approx(8.5e-3 + profile[4] - profile[1])
    assert policy.choose(0, 128) == 3


def test_a_price_far_above_its_neighbours_is_capped():
    """Batch 1, 8B shape, forced acceptance 4 on an H100 (2026-11-27): k = 4's first three samples
    took 14.5 ms, k = 3's 1.4, and nothing ran k = 4 again (0.89x the best fixed k). No price
    exceeds OUTLIER^|k - j| times another k's."""
    costs = StepCosts([1], [[5.3e-3, 6.0e-3, 7.2e-3, 7.7e-3, 8.5e-3, 9.0e-3]], "measured on d")
    policy = AdaptiveDraftLength(5, costs, AcceptanceTracker(5, prior=1.0, prior_weight=1e6))
    for k, period in ((3, 7.8e-3), (4, 31e-3), (5, 9.1e-3)):
        for _ in range(3):
            policy.observe_step(1, k, period)
    assert policy.times.observed(1) == pytest.approx({3: 7.8e-3, 4: 15.6e-3, 5: 9.1e-3})
    assert policy.choose(0, 1) == 5  # every draft accepted: 6 tokens for 9.1 ms
