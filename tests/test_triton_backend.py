"""The engine on the Triton attention backend (the GPU default), run here under TRITON_INTERPRET,
gives the reference backend's tokens, with and without an EAGLE3 draft."""
from __future__ import annotations

import pytest

from atom_like import LLMEngine, SamplingParams
from model_ops.attention.backends import TritonMHABackend

PROMPTS = [[5, 9, 13, 2], list(range(20, 39)), [77]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("spec", [False, True])
def test_triton_backend_matches_reference(make_llama, make_eagle3_llama, spec):
    target = make_llama(num_hidden_layers=8, seed=1)
    kwargs = dict(max_model_len=64, num_kv_blocks=70_000 if spec else 16, block_size=2 if spec else 16)
    if spec:  # draft on Triton with block ids past 65,535
        kwargs.update(method="eagle3", draft_model=make_eagle3_llama(target), num_speculative_tokens=3)
    reference = LLMEngine(target, attention_backend="torch", **kwargs)
    expected = [o.token_ids for o in reference.generate(PROMPTS, GREEDY, use_tqdm=False)]
    engine = LLMEngine(target, attention_backend="triton", **kwargs)
    assert all(isinstance(b.backend, TritonMHABackend) for b in engine.runner.builders)
    if spec:
        engine.block_manager.free_blocks.rotate(-65_600)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_unknown_backend_is_named(make_llama):
    with pytest.raises(ValueError, match="--attention-backend must be one of auto, torch, triton, aiter"):
        LLMEngine(make_llama(), attention_backend="flash")
    with pytest.raises(ValueError, match="--attention-backend aiter is not available: the device is the CPU"):
        LLMEngine(make_llama(), attention_backend="aiter")
