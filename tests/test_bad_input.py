"""Bad input gets a ValueError naming the problem, and the engine keeps serving."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from atom_like import LLMEngine, SamplingParams

OK = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_path):
    return LLMEngine(llama_path, max_model_len=64)


@pytest.mark.parametrize("prompt,params,match", [
    ([], OK, "prompt is empty"),
    (list(range(64)), OK, "max_model_len"),
    ([1, 2, 999], OK, r"token ids must be integers in \[0, 128\)"),
    ([1, 2, 128], OK, r"token ids must be integers in \[0, 128\)"),  # the vocab size itself
    ("some text", OK, "no tokenizer"),
])
def test_bad_prompt(engine, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert engine.generate([[1, 2, 3]], OK, use_tqdm=False)[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=-1), "max_tokens"),  # 0 is allowed: the prompt's forward alone (prompt_logprobs)
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(seed=2**64), "seed"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("ids", [[1, 128], [-1, 5], [3, 2.0]])
def test_bad_prompt_ids_are_refused(engine, ids):
    """prompt_ids (token ids the caller already has, e.g. a rendered chat) skip tokenization, not
    validation: an id outside the vocabulary would otherwise index past the embedding."""
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 128\)"):
        engine.add_request(None, OK, prompt_ids=ids)
    assert not engine.has_unfinished_requests()


def test_bad_prompt_in_generate_adds_nothing(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([[1, 2], []], OK, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.generate([[5, 6]], OK, use_tqdm=False)[0].token_ids


def test_unknown_architecture(llama_path, tmp_path):
    path = shutil.copytree(llama_path, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown model architecture.*MysteryForCausalLM.*supported: .*LlamaForCausalLM"):
        LLMEngine(str(path))


def test_missing_weight_file(llama_path, tmp_path):
    path = shutil.copytree(llama_path, tmp_path / "m")
    os.remove(path / "model.safetensors")
    with pytest.raises(ValueError, match="no weight file"):
        LLMEngine(str(path))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        LLMEngine(str(tmp_path))


def test_tensor_parallel_size_that_does_not_divide_the_vocabulary(llama_path):
    with pytest.raises(ValueError, match="vocab_size 128 is not divisible by --tensor-parallel-size 3"):
        LLMEngine(llama_path, tensor_parallel_size=3)
