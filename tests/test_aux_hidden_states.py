"""EAGLE3 target interface: aux layer ids (both conventions), capture through the paged path
against transformers' output_hidden_states, and embed/head access (Llama, DeepSeek-V3, Kimi)."""
from __future__ import annotations

import logging

import pytest
import torch
from test_llama_parity import PROMPTS, prefill_logits
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from atom_like import LLMEngine
from atom_like.models.base import Eagle3Target
from atom_like.models.kimi_k25 import KimiK25ForConditionalGeneration
from spec_decode.aux_layers import AuxHiddenStates, default_aux_layer_ids, resolve_aux_layer_ids

LAYERS = 7  # the smallest depth whose default ids (2, N//2, N-3) are distinct: [2, 3, 4]


@pytest.fixture(scope="module")
def checkpoints(make_llama, make_deepseek):
    return {
        "llama": make_llama(num_hidden_layers=LAYERS),
        "deepseek_v3": make_deepseek("v3", num_hidden_layers=LAYERS),
        "kimi_k25": make_deepseek("kimi", num_hidden_layers=LAYERS, n_group=1, topk_group=1),
    }


def hf_model(kind: str, path: str):
    auto = AutoModelForImageTextToText if kind == "kimi_k25" else AutoModelForCausalLM
    hf = auto.from_pretrained(path, dtype=torch.float32).eval()
    decoder = hf.model.language_model if kind == "kimi_k25" else hf.model
    return hf, decoder.layers[-1]


def capture(engine: LLMEngine, layer_ids) -> list[torch.Tensor]:
    """Aux states of every prompt position, all prompts in one batch through the paged cache."""
    model = engine.runner.model
    model.set_eagle3_layers_to_capture(layer_ids)
    aux = AuxHiddenStates(model.eagle3_aux_layer_ids, 512, model.config.hidden_size, torch.float32, "cpu")
    model.bind_aux_hidden_states(aux)
    prefill_logits(engine, PROMPTS)
    model.bind_aux_hidden_states(None)
    return list(aux.get(sum(map(len, PROMPTS))).split([len(p) for p in PROMPTS]))


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3", "kimi_k25"])
def test_capture_equals_transformers_hidden_states(checkpoints, kind):
    engine = LLMEngine(checkpoints[kind], max_model_len=256)
    assert isinstance(engine.runner.model, Eagle3Target)
    hf, last_layer = hf_model(kind, checkpoints[kind])
    pre_norm = []
    last_layer.register_forward_hook(lambda m, i, out: pre_norm.append(out[0] if isinstance(out, tuple) else out))

    defaults = capture(engine, None)
    assert engine.runner.model.eagle3_aux_layer_ids == [2, 3, 4]
    for prompt, got in zip(PROMPTS, defaults):
        with torch.no_grad():
            states = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
        ref = torch.cat([states[i][0] for i in (2, 3, 4)], dim=-1)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))

    # "output of layer X" ids (first id 1) capture the same tensors as the +1 ids; id N is the
    # stream after the last layer, before the final norm (transformers' hidden_states[N] is after it)
    shifted, explicit = capture(engine, [1, 3, LAYERS - 1]), capture(engine, [2, 4, LAYERS])
    for prompt, a, b, last in zip(PROMPTS, shifted, explicit, pre_norm):
        assert torch.equal(a, b)
        ref = last[0]
        torch.testing.assert_close(b[:, -ref.shape[-1]:], ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_resolve_conventions_and_defaults(caplog):
    assert default_aux_layer_ids(61) == [2, 30, 58]
    assert resolve_aux_layer_ids(None, 61) == [2, 30, 58]
    with caplog.at_level(logging.INFO, logger="spec_decode.aux_layers"):
        assert resolve_aux_layer_ids([1, 29, 57], 61) == [2, 30, 58]
        assert "'output of layer X' convention" in caplog.text
        assert resolve_aux_layer_ids((2, 30, 58), 61) == [2, 30, 58]
        assert "'input of layer X' convention" in caplog.text
    assert resolve_aux_layer_ids([0, 61], 61) == [0, 61]
    assert resolve_aux_layer_ids([1, 60], 61) == [2, 61]


@pytest.mark.parametrize("ids,layers,match", [
    ([2, 30, 62], 61, r"outside \[0, 61\]"),
    ([1, 30, 61], 61, r"\[2, 31, 62\], outside"),
    ([-1, 3], 61, "outside"),
    ([5, 3, 9], 61, "not in ascending order"),
    ([], 61, "is empty"),
    (None, 4, r"\[2, 2, 1\], which are not in ascending order.*explicit ids"),
])
def test_bad_aux_ids_name_the_field(ids, layers, match):
    with pytest.raises(ValueError, match=match) as err:
        resolve_aux_layer_ids(ids, layers)
    assert "eagle_aux_hidden_state_layer_ids" in str(err.value) or ids is None


def test_shallow_targets_repeat_default_ids(caplog):
    """As vLLM, SGLang and ATOM: (2, N//2, N-3) is the default at any depth >= 5, repeats included,
    with one log line; explicit repeated ids are accepted too."""
    with caplog.at_level(logging.INFO, logger="spec_decode.aux_layers"):
        assert resolve_aux_layer_ids(None, 6) == [2, 3, 3]
    assert [r.getMessage() for r in caplog.records if "repeats a layer" in r.getMessage()] == [
        "default (2, N//2, N-3) for num_hidden_layers=6 gives capture ids [2, 3, 3]: a target this shallow "
        "repeats a layer, captured once per id (vLLM, SGLang and ATOM use the same defaults)"]
    assert resolve_aux_layer_ids(None, 5) == [2, 2, 2]
    assert resolve_aux_layer_ids([2, 3, 3], 6) == [2, 3, 3]


def test_repeated_id_is_captured_in_each_of_its_columns(make_llama):
    """A 6-layer target with default ids: the buffer holds transformers' hidden_states[2, 3, 3]."""
    path = make_llama(num_hidden_layers=6)
    engine = LLMEngine(path, max_model_len=64)
    got = capture(engine, None)
    assert engine.runner.model.eagle3_aux_layer_ids == [2, 3, 3]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, aux in zip(PROMPTS, got):
        with torch.no_grad():
            states = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
        ref = torch.cat([states[i][0] for i in (2, 3, 3)], dim=-1)
        torch.testing.assert_close(aux, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_draft_without_ids_runs_on_a_shallow_target(make_llama, make_eagle3_llama):
    """The user's case: a draft that states no aux ids (fc reads 3 states) on a 6-layer target is
    served, losslessly, where the default ids repeat layer 3."""
    from atom_like import SamplingParams

    target = make_llama(num_hidden_layers=6)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in LLMEngine(target, max_model_len=128).generate(PROMPTS, greedy, use_tqdm=False)]
    engine = LLMEngine(target, max_model_len=128, method="eagle3", draft_model=make_eagle3_llama(target),
                       num_speculative_tokens=2)
    assert engine.runner.model.eagle3_aux_layer_ids == [2, 3, 3]
    assert [o.token_ids for o in engine.generate(PROMPTS, greedy, use_tqdm=False)] == plain


def test_buffer_columns_follow_ascending_ids():
    aux = AuxHiddenStates([2, 5], max_tokens=8, hidden_size=3, dtype=torch.float32, device="cpu")
    aux.capture(5, torch.full((4, 3), 5.0))
    aux.capture(3, torch.full((4, 3), 3.0))  # not captured: no-op
    aux.capture(2, torch.full((4, 3), 2.0))
    assert aux.get(4).tolist() == [[2.0] * 3 + [5.0] * 3] * 4
    assert aux.buffer[4:].abs().sum() == 0


def test_bind_and_embed_head(checkpoints):
    model = LLMEngine(checkpoints["deepseek_v3"], max_model_len=64).runner.model
    aux = AuxHiddenStates([2, 3, 4], 8, model.config.hidden_size, torch.float32, "cpu")
    with pytest.raises(ValueError, match="before set_eagle3_layers_to_capture"):
        model.bind_aux_hidden_states(aux)
    model.set_eagle3_layers_to_capture([2, 4, 6])
    with pytest.raises(ValueError, match=r"captures layers \[2, 3, 4\] but the target resolved \[2, 4, 6\]"):
        model.bind_aux_hidden_states(aux)

    embed, head = model.get_embed_and_head()
    assert embed.shape == head.shape == (128, 64) and embed.data_ptr() != head.data_ptr()
    new_embed, new_head = torch.randn(128, 64), torch.randn(128, 64)
    model.set_embed_and_head(new_embed, new_head)
    got_embed, got_head = model.get_embed_and_head()
    assert got_embed.data_ptr() == new_embed.data_ptr() and got_head.data_ptr() == new_head.data_ptr()
    with pytest.raises(ValueError, match=r"head has shape \(128, 32\), expected \(128, 64\)"):
        model.set_embed_and_head(new_embed, torch.randn(128, 32))


def test_kimi_delegates_to_its_language_model(checkpoints):
    model = LLMEngine(checkpoints["kimi_k25"], max_model_len=64).runner.model
    assert isinstance(model, KimiK25ForConditionalGeneration) and isinstance(model, Eagle3Target)
    model.set_eagle3_layers_to_capture([1, 3, 5])
    assert model.eagle3_aux_layer_ids == model.language_model.eagle3_aux_layer_ids == [2, 4, 6]
    assert model.get_embed_and_head()[0] is model.language_model.model.embed_tokens.weight

    model.language_model = torch.nn.Linear(2, 2)  # an inner model without the capability
    with pytest.raises(TypeError, match="Linear does not implement Eagle3Target"):
        model.set_eagle3_layers_to_capture(None)
