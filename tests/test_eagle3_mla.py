"""EAGLE3 / EAGLE3.1 with the MLA draft (Eagle3DeepseekV2ForCausalLM) on the tiny DeepSeek-V3 and
Kimi-K2.5 targets: lossless greedy output in every flag combination, acceptance equal to the
plain-PyTorch reference loop, the draft's latent KV pool, the static decode path, the Triton
backend, and malformed draft configs named."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from test_decode_graphs import count_replays

from atom_like import LLMEngine, SamplingParams
from atom_like.models.eagle3_mla import Eagle3DeepseekV2ForCausalLM
from model_ops.attention.backends import TorchMLABackend, TritonMLABackend

rng = np.random.default_rng(7)
PROMPTS = [[int(x) for x in rng.integers(0, 128, n)] for n in (3, 29, 11)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MAX_LEN = 96
TARGETS = {"v3": ("v3", {}), "kimi": ("kimi", dict(n_group=1, topk_group=1, routed_scaling_factor=2.827))}
# 3-layer targets. kimi: "output of layer" ids, captured as the inputs of layers 2 and 3 (3 = the
# last layer's output before the final norm): two aux states, so fc reads 2 x 64
AUX = {"v3": (0, 1, 2), "kimi": (1, 2)}
FLAGS = {
    "plain": {},
    "fc_norm": dict(fc_norm=True),
    "use_aux_norm": dict(legacy_aux_norm=True),  # the legacy spelling of fc_norm
    "norm_output": dict(norm_output=True),
    "fc_norm+norm_output": dict(fc_norm=True, norm_output=True),
}


@pytest.fixture(scope="module")
def targets(make_deepseek):
    return {name: make_deepseek(arch, **kw) for name, (arch, kw) in TARGETS.items()}


@pytest.fixture(scope="module")
def baselines(targets):
    return {name: generate(LLMEngine(path, max_model_len=MAX_LEN)) for name, path in targets.items()}


@pytest.fixture(scope="module")
def frequent(baselines):
    """The three tokens the targets emit most: a draft vocabulary of just these (d2t) gets some
    drafts accepted without training, so accepted rows and chains are exercised too."""
    return {name: [int(t) for t in np.bincount(sum(outs, []), minlength=128).argsort()[::-1][:3]]
            for name, outs in baselines.items()}


def spec_engine(target, draft, k, **kwargs):
    # k every step (tests/test_adaptive_spec.py varies it): the acceptance checks below count on k drafts
    return LLMEngine(target, method="eagle3", draft_model=draft, num_speculative_tokens=k, speculative_adaptive=False,
                     **{"max_model_len": MAX_LEN, **kwargs})


def generate(engine, prompts=PROMPTS):
    return [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]


def assert_no_leak(engine):
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ----------------------------------------------------------------------------- lossless

@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("target", TARGETS)
def test_every_flag_combination_is_lossless(targets, baselines, make_eagle3_mla, target, flags):
    """k=3 only: a flag changes the draft's layer math, which the first pass and the chain share;
    k=1 (no chain) runs in test_draft_variants_are_lossless."""
    draft = make_eagle3_mla(targets[target], aux_layer_ids=AUX[target], **FLAGS[flags])
    engine = spec_engine(targets[target], draft, 3)
    assert isinstance(engine.runner.proposer.draft, Eagle3DeepseekV2ForCausalLM)
    assert generate(engine) == baselines[target]
    assert engine.spec_stats.num_drafts > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("variant", ["d2t", "chunked"])  # fused_qkv_a: test_fused_down_projection_loads_like_the_separate_ones
@pytest.mark.parametrize("target", TARGETS)
def test_draft_variants_are_lossless(targets, baselines, frequent, make_eagle3_mla, target, variant):
    options, kwargs = dict(aux_layer_ids=AUX[target], fc_norm=True, norm_output=True), {}
    if variant == "d2t":  # a 3-token draft vocabulary: target id = draft id + d2t[draft id]
        options["draft_vocab_ids"] = frequent[target]
    else:  # 8-token steps: the draft's first pass runs over middle prompt chunks too
        options["draft_vocab_ids"], kwargs["max_num_batched_tokens"] = frequent[target], 8
    for k in (1, 3):
        engine = spec_engine(targets[target], make_eagle3_mla(targets[target], **options), k, **kwargs)
        assert generate(engine) == baselines[target], f"k={k}"
        assert engine.spec_stats.num_accepted_tokens > 0  # accepted drafts were exercised
        assert_no_leak(engine)


def test_fused_down_projection_loads_like_the_separate_ones(targets, make_eagle3_mla):
    drafts = [spec_engine(targets["v3"], make_eagle3_mla(targets["v3"], fused_qkv_a=fused), 3).runner.proposer.draft
              for fused in (False, True)]
    for (name, a), (_, b) in zip(drafts[0].state_dict().items(), drafts[1].state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("flags", ["plain", "fc_norm+norm_output"])
def test_acceptance_equals_the_reference_loop(targets, frequent, make_eagle3_mla, flags):
    """The engine accepts exactly what the plain-PyTorch eager loop (eagle3_train.eagle3_reference, with
    transformers' target) accepts, step for step: the draft's math, positions, KV and chain agree."""
    from transformers import AutoModelForCausalLM

    from eagle3_train import eagle3_reference as R

    k, path = 3, make_eagle3_mla(targets["v3"], draft_vocab_ids=frequent["v3"], **FLAGS[flags])
    hf = AutoModelForCausalLM.from_pretrained(targets["v3"], dtype=torch.float32).eval()
    ref = R.load_draft(path)
    expected = [0] * (k + 1)
    for prompt in PROMPTS:
        engine = spec_engine(targets["v3"], path, k)
        tokens, counts = R.reference_speculate(hf, ref, prompt, k, GREEDY.max_tokens)
        assert generate(engine, [prompt]) == [tokens]
        assert engine.spec_stats.accepted_histogram == list(np.bincount(counts, minlength=k + 1))
        expected = [a + b for a, b in zip(expected, engine.spec_stats.accepted_histogram)]
    assert sum(expected[1:]) > 0  # some drafts were accepted


# ----------------------------------------------------------------------------- KV pool

def test_draft_latent_pool_shares_the_target_blocks(targets, make_eagle3_mla):
    engine = spec_engine(targets["v3"], make_eagle3_mla(targets["v3"]), 3, num_kv_blocks=40)
    runner = engine.runner
    assert sorted(runner.kv_caches) == ["eagle3_kv_cache", "kv_cache"]
    draft_builder = runner.proposer.kv_builders()[0]
    assert isinstance(draft_builder.backend, TorchMLABackend)
    assert [layer.kind for layer in runner.proposer.draft.attention_layers()] == ["mla"]
    pool_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches.values())
    assert pool_bytes == (runner.num_blocks + 1) * sum(b.compute_block_bytes() for b in runner.builders)
    target_pool, draft_pool = runner.kv_caches["kv_cache"], runner.kv_caches["eagle3_kv_cache"]
    # one latent row per token: the target's 32 + 8 wide, the draft's own kv_lora_rank 16 + rope 8
    assert target_pool.shape == (3, 41, 16, 40) and draft_pool.shape == (1, 41, 16, 24)
    assert draft_builder.compute_block_bytes() == 16 * 24 * 4
    draft_pool.fill_(float("nan"))
    target_pool.fill_(float("nan"))
    engine.add_request(PROMPTS[1], GREEDY, request_id="x")
    for _ in range(4):
        engine.step()
    seq = engine.scheduler.running[0]
    written = lambda pool: set(torch.nonzero(~pool[0].isnan().all(-1).flatten()).flatten().tolist())  # noqa: E731
    own_slots = {b * 16 + o for b in seq.block_table for o in range(16)}
    target_slots, draft_slots = written(target_pool), written(draft_pool)
    assert target_slots and target_slots <= draft_slots <= own_slots  # the draft writes where the target does
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(engine)


def test_preemption_and_chunking_leak_no_blocks(targets, baselines, frequent, make_eagle3_mla):
    draft = make_eagle3_mla(targets["kimi"], aux_layer_ids=AUX["kimi"], draft_vocab_ids=frequent["kimi"])
    # 5 blocks of 16 tokens: the three sequences cannot all stay resident
    engine = spec_engine(targets["kimi"], draft, 3, num_kv_blocks=5, max_model_len=64, max_num_batched_tokens=16)
    assert generate(engine) == baselines["kimi"]
    assert engine.scheduler.num_preemptions > 0
    assert_no_leak(engine)


# ----------------------------------------------------------------------------- execution paths

def test_static_decode_matches_eager(targets, frequent, make_eagle3_mla, monkeypatch):
    draft = make_eagle3_mla(targets["v3"], draft_vocab_ids=frequent["v3"], fc_norm=True, norm_output=True)
    eager = spec_engine(targets["v3"], draft, 3, enforce_eager=True)
    expected = generate(eager)
    calls = count_replays(monkeypatch)
    graphed = spec_engine(targets["v3"], draft, 3)
    assert generate(graphed) == expected
    assert calls["target"] > 0 and calls["draft"] > 0
    assert graphed.spec_stats.accepted_histogram == eager.spec_stats.accepted_histogram
    assert_no_leak(graphed)


def test_triton_backend_matches_reference(targets, frequent, make_eagle3_mla):
    pytest.importorskip("kernels_rocm.mla_decode")
    draft = make_eagle3_mla(targets["v3"], draft_vocab_ids=frequent["v3"], fc_norm=True)
    prompts, kwargs = PROMPTS[:2], dict(max_model_len=48, num_kv_blocks=8, enforce_eager=True)
    expected = generate(spec_engine(targets["v3"], draft, 3, attention_backend="torch", **kwargs), prompts)
    engine = spec_engine(targets["v3"], draft, 3, attention_backend="triton", **kwargs)
    assert all(isinstance(b.backend, TritonMLABackend) for b in engine.runner.builders)
    assert generate(engine, prompts) == expected


# ----------------------------------------------------------------------------- errors

def edited_draft(src: str, tmp_path, edit) -> str:
    path = shutil.copytree(src, tmp_path / "draft")
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.pop("q_lora_rank"), "no q_lora_rank"),  # not silently DeepseekV3Config's 1536
    (lambda c: c.update(q_lora_rank=None), "no q_lora_rank"),
    (lambda c: c.pop("kv_lora_rank"), "no kv_lora_rank"),
    (lambda c: c.update(kv_lora_rank=0), "kv_lora_rank must be a positive integer"),
    (lambda c: c.update(kv_lora_rank="16"), "config.json: .*field 'kv_lora_rank'"),  # transformers' typed field
    (lambda c: c.update(v_head_dim=-12), "v_head_dim must be a positive integer"),
    (lambda c: c.update(qk_rope_head_dim=7), "qk_rope_head_dim 7 is odd"),
    # dims the weights contradict: the loader names the tensor and both shapes
    (lambda c: c.update(kv_lora_rank=64), r"self_attn\.kv_a_\w+\.weight' has shape \((16|24),.* expects \((64|72),"),
    (lambda c: c.update(num_hidden_layers=2), "exactly one decoder layer"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu'"),
    (lambda c: c["eagle_config"].update(use_aux_hidden_state=False), "use_aux_hidden_state is false"),
    (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1]), "fc.weight' has shape"),
])
def test_malformed_draft_configs_are_named(targets, make_eagle3_mla, tmp_path, edit, match):
    path = edited_draft(make_eagle3_mla(targets["v3"]), tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        spec_engine(targets["v3"], path, 3)


def test_family_comes_from_architectures_alone(targets, baselines, make_eagle3_mla, tmp_path):
    path = edited_draft(make_eagle3_mla(targets["v3"]), tmp_path, lambda c: c.update(model_type="deepseek_v3"))
    engine = spec_engine(targets["v3"], path, 3)
    assert isinstance(engine.runner.proposer.draft, Eagle3DeepseekV2ForCausalLM)
    assert generate(engine) == baselines["v3"]
