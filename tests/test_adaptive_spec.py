"""Speculation with the draft count k chosen per step (0..num_speculative_tokens, spec_decode/adaptive.py):
greedy output identical to no speculation while k switches every step (0 included), on the MHA
and MLA drafts, overlapped and not, eager and through the static decode path; statistics equal a
hand count; the real policy in the engine (opt-in, lossless, no device reads, seeded requests).
The policy on its own is tested in tests/test_adaptive_policy.py.

Costs (2 shared cores): each test builds tiny fp32 models (a few seconds each); the whole file ~1-2 min."""
from __future__ import annotations

import numpy as np
import pytest

from oracle_proposer import OracleProposer, accept_first

from atom_like import LLMEngine, SamplingParams
from spec_decode.adaptive import AdaptiveDraftLength, DraftLengthPolicy

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
