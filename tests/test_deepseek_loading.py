"""DeepSeek / Kimi checkpoints: expert and wrapper name layouts, skipped MTP and vision weights,
older config spellings (rope_scaling, model_type kimi_k2), and config errors through the engine."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_llama_parity import PROMPTS, prefill_logits

from atom_like import LLMEngine

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}


def rewrite(src: str, dst, edit_tensors=None, edit_config=None) -> str:
    path = shutil.copytree(src, dst)
    if edit_tensors is not None:
        tensors = load_file(str(path / "model.safetensors"))
        tensors = edit_tensors(tensors)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((path / "config.json").read_text())
        edit_config(config)
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


def logits(path: str) -> list[torch.Tensor]:
    return prefill_logits(LLMEngine(path, max_model_len=128), PROMPTS[:2])


def assert_same_logits(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_stacked_expert_tensors_load_like_per_expert_ones(make_deepseek, tmp_path):
    """transformers' in-memory layout: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    src = make_deepseek("v3")

    def stack(tensors):
        out, experts = {}, {}
        for name, t in tensors.items():
            m = re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$", name)
            if m:
                experts.setdefault(m[1], {})[(int(m[2]), m[3])] = t
            else:
                out[name] = t
        for prefix, parts in experts.items():
            n = 1 + max(e for e, _ in parts)
            out[f"{prefix}.gate_up_proj"] = torch.stack(
                [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(n)])
            out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
        return out

    path = rewrite(src, tmp_path / "stacked", edit_tensors=stack)
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(os.path.join(path, "model.safetensors")))
    assert_same_logits(logits(path), logits(src))


def test_fused_q_kv_down_projection_loads_like_the_separate_ones(make_deepseek, tmp_path):
    """sglang-style checkpoints fuse q_a_proj and kv_a_proj_with_mqa (q rows first)."""
    src = make_deepseek("v3")

    def fuse(tensors):
        for q_name in [k for k in tensors if k.endswith("self_attn.q_a_proj.weight")]:
            kv_name = q_name.replace("q_a_proj", "kv_a_proj_with_mqa")
            fused = torch.cat([tensors.pop(q_name), tensors.pop(kv_name)])
            tensors[q_name.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")] = fused
        return tensors

    path = rewrite(src, tmp_path / "fused", edit_tensors=fuse)
    assert_same_logits(logits(path), logits(src))


def test_missing_expert_is_named(make_deepseek, tmp_path):
    def drop(tensors):
        tensors.pop("model.layers.2.mlp.experts.5.up_proj.weight")
        return tensors
    path = rewrite(make_deepseek("v3"), tmp_path / "m", edit_tensors=drop)
    with pytest.raises(ValueError, match=r"model.layers.2.mlp.experts.w13 \(shard 5.up_proj\)"):
        LLMEngine(path, max_model_len=64)


def test_mtp_layers_are_skipped_with_one_log_line(make_deepseek, tmp_path, caplog):
    src = make_deepseek("v3")  # 3 layers; transformers' config says num_nextn_predict_layers 1

    def add_mtp(tensors):
        mtp = {k.replace(".layers.2.", ".layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
        return {**tensors, **mtp, "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
                "model.layers.3.enorm.weight": torch.ones(64)}

    path = rewrite(src, tmp_path / "mtp", edit_tensors=add_mtp)
    with caplog.at_level(logging.INFO, logger="atom_like.loader.weights"):
        got = logits(path)
    assert len([r for r in caplog.records if "multi-token-prediction" in r.getMessage()]) == 1
    assert_same_logits(got, logits(src))


def kimi_layout(tensors: dict, layout: str) -> dict:
    """transformers 5.23 writes language_model.model.blocks.*; the hub has .layers.*; transformers'
    in-memory names are model.language_model.* + lm_head.weight."""
    def rename(name):
        name = name.replace("language_model.model.blocks.", "language_model.model.layers.")
        if layout == "in_memory":
            name = re.sub(r"^language_model\.model\.", "model.language_model.", name)
            name = re.sub(r"^language_model\.lm_head\.", "lm_head.", name)
        return name
    return {rename(k): v for k, v in tensors.items()}


def test_kimi_checkpoint_layouts_and_skipped_vision(make_deepseek, tmp_path, caplog):
    src = make_deepseek("kimi", n_group=1, topk_group=1)
    saved = load_file(os.path.join(src, "model.safetensors"))
    assert any(k.startswith("language_model.model.blocks.") for k in saved), "transformers' save layout changed"
    assert any(k.startswith("vision_tower.") for k in saved) and any("mm_projector." in k for k in saved)
    with caplog.at_level(logging.INFO, logger="atom_like.loader.weights"):
        expected = logits(src)
    messages = caplog.text
    assert "vision tower (text path only)" in messages and "multimodal projector (text path only)" in messages
    for layout in ("hub", "in_memory"):
        path = rewrite(src, tmp_path / layout, edit_tensors=lambda t, layout=layout: kimi_layout(t, layout))
        assert_same_logits(logits(path), expected)


def old_spelling(config: dict) -> None:
    """Pre-transformers-5 DeepSeek/Kimi spelling: rope_theta + rope_scaling {type: yarn}; kimi_k2."""
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    config["model_type"] = "kimi_k2"


def test_older_config_spellings_give_the_same_logits(make_deepseek, tmp_path):
    src = make_deepseek("v3")
    assert json.loads(open(os.path.join(src, "config.json")).read())["rope_parameters"] == YARN
    path = rewrite(src, tmp_path / "k2", edit_config=old_spelling)
    assert_same_logits(logits(path), logits(src))

    kimi = make_deepseek("kimi", n_group=1, topk_group=1)
    kimi_old = rewrite(kimi, tmp_path / "k25", edit_config=lambda c: old_spelling(c["text_config"]))
    assert json.loads(open(os.path.join(kimi_old, "config.json")).read())["text_config"]["model_type"] == "kimi_k2"
    assert_same_logits(logits(kimi_old), logits(kimi))


@pytest.mark.parametrize("field,value,match", [
    ("scoring_func", "sqrtsoftplus", "scoring_func 'sqrtsoftplus'"),
    ("topk_group", 5, "topk_group 5 > n_group 4"),
])
def test_bad_config_json_is_named(make_deepseek, tmp_path, field, value, match):
    path = rewrite(make_deepseek("v3"), tmp_path / "bad", edit_config=lambda c: c.update({field: value}))
    with pytest.raises(ValueError, match=match):
        LLMEngine(path, max_model_len=64)


def test_unknown_architecture_lists_the_supported_ones(make_deepseek, tmp_path):
    path = rewrite(make_deepseek("v3"), tmp_path / "arch", edit_config=lambda c: c.update(architectures=["FooLM"]))
    with pytest.raises(ValueError, match=r"unknown model architecture \['FooLM'\].*DeepseekV3ForCausalLM.*KimiK25"):
        LLMEngine(path, max_model_len=64)
