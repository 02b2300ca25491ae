"""The static-buffer decode path (CUDA graphs on a GPU; re-run from the same buffers here) must
give exactly the eager tokens, for batches padded up to their bucket, with and without drafts."""
from __future__ import annotations

import numpy as np
import pytest
from engine_checks import install_checks, run_checked

from atom_like import LLMEngine, SamplingParams
from atom_like.engine.cuda_graph import DecodeGraphs

rng = np.random.default_rng(5)
PROMPTS = [[int(x) for x in rng.integers(0, 128, n)] for n in (4, 19, 7)]  # 3 sequences: bucket 4, one padded row
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def count_replays(monkeypatch) -> dict:
    calls = {"target": 0, "draft": 0}
    replay_target, replay_draft = DecodeGraphs.replay_target, DecodeGraphs.replay_draft

    def target(self, num_seqs):
        calls["target"] += 1
        return replay_target(self, num_seqs)

    def draft(self, *args):
        calls["draft"] += 1
        return replay_draft(self, *args)

    monkeypatch.setattr(DecodeGraphs, "replay_target", target)
    monkeypatch.setattr(DecodeGraphs, "replay_draft", draft)
    return calls


@pytest.mark.parametrize("spec", [False, True])
def test_static_decode_matches_eager(make_llama, make_eagle3_llama, monkeypatch, spec):
    target = make_llama(num_hidden_layers=8, seed=1)
    kwargs = dict(max_model_len=96)
    if spec:
        kwargs.update(method="eagle3", draft_model=make_eagle3_llama(target, draft_vocab_size=64, fc_norm=True),
                      num_speculative_tokens=3)
    eager = LLMEngine(target, enforce_eager=True, **kwargs)
    expected = [o.token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    calls = count_replays(monkeypatch)
    graphed = LLMEngine(target, **kwargs)
    assert graphed.runner.graphs.buckets[:3] == [1, 2, 4]
    assert [o.token_ids for o in graphed.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert calls["target"] > 0 and (calls["draft"] > 0) == spec
    if spec:
        assert graphed.spec_stats.num_drafts == eager.spec_stats.num_drafts
    assert graphed.block_manager.num_free_blocks == graphed.block_manager.num_blocks


def test_padded_rows_touch_only_the_scratch_block(make_llama, make_eagle3_llama):
    target = make_llama(num_hidden_layers=8, seed=1)
    engine = LLMEngine(target, max_model_len=96, num_kv_blocks=20, method="eagle3",
                       draft_model=make_eagle3_llama(target), num_speculative_tokens=3)
    pools = engine.runner.kv_caches
    sentinel = 7.0  # finite: padded rows attend over the scratch block themselves
    for pool in pools.values():
        pool.fill_(sentinel)
    engine.generate(PROMPTS, GREEDY, use_tqdm=False)  # three sequences run in bucket 4 with a padded row
    scratch = engine.runner.num_blocks
    assert (pools["eagle3_kv_cache"][:, :, scratch] != sentinel).any()  # the padded row's draft chain wrote here
    assert (pools["kv_cache"][:, :, scratch] == sentinel).all()  # the target writes nothing for padded rows


@pytest.mark.timeout(600)
def test_a_batch_shrinking_within_its_bucket_writes_only_owned_blocks(make_llama, make_eagle3_llama):
    """Four sequences decode in bucket 4, then one finishes and three run in bucket 4: the freed
    row must point at the scratch block again, not at the blocks its sequence gave back (the draft
    chain writes through the padded rows' block tables). Every step, the free blocks of both pools
    must keep their bytes (sentinel), and the tokens equal the eager engine's."""
    target = make_llama(num_hidden_layers=8, seed=1)
    kwargs = dict(max_model_len=96, method="eagle3", draft_model=make_eagle3_llama(target), num_speculative_tokens=3)
    prompts = PROMPTS + [PROMPTS[0][:2]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 12, 12, 4)]
    eager = LLMEngine(target, enforce_eager=True, **kwargs)
    expected = [o.token_ids for o in run_checked(eager, prompts, params)]
    engine = LLMEngine(target, **kwargs)
    install_checks(engine, sentinel=True)
    assert [o.token_ids for o in run_checked(engine, prompts, params)] == expected
    assert engine.spec_stats.accepted_histogram == eager.spec_stats.accepted_histogram
