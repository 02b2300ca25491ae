"""Text outputs: detokenization, stop strings and eos through the engine."""
from __future__ import annotations

import pytest

from atom_like import LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(make_llama):
    return LLMEngine(make_llama(tokenizer=True), max_model_len=128)


def test_text_is_the_continuation_of_the_prompt(engine):
    """Text is what decoding prompt + output adds to the decoded prompt (so a leading space
    that separates the continuation from the prompt is kept, as in OpenAI-style completions)."""
    out = engine.generate("w5 w9 w13", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt == "w5 w9 w13"
    decode = engine.tokenizer.decode
    assert out.text == decode(out.prompt_token_ids + out.token_ids)[len(decode(out.prompt_token_ids)):]


def test_stop_string_truncates_text_and_tokens(engine):
    free = engine.generate("w5 w9 w13", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    words = free.text.split()
    stop = " " + words[4]
    cut = words.index(words[4])  # the first occurrence ends the output
    out = engine.generate("w5 w9 w13", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                          use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(stop)]
    assert out.token_ids == free.token_ids[: cut + 1]


def test_eos_stops_unless_ignored(engine):
    eos = engine.tokenizer.eos_token_id
    free = engine.generate([3, 4], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    engine.eos_token_ids.add(free.token_ids[5])  # pretend the 6th generated token is an end-of-sequence
    try:
        out = engine.generate([3, 4], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
        first = next(i for i, t in enumerate(free.token_ids) if t in engine.eos_token_ids)
        assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    finally:
        engine.eos_token_ids.discard(free.token_ids[5])
        engine.eos_token_ids.add(eos)
