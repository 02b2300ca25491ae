"""Checkpoint loading: sharded files, tied heads, the dtype rule, and errors naming tensors."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom_like import LLMEngine, SamplingParams
from atom_like.loader.weights import convert_dtype

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def rewrite(src: str, dst, edit) -> str:
    path = shutil.copytree(src, dst)
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def test_sharded_checkpoint_with_index(llama_path, tmp_path):
    tensors = load_file(os.path.join(llama_path, "model.safetensors"))
    path = shutil.copytree(llama_path, tmp_path / "sharded")
    os.remove(path / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    prompt = [[4, 8, 15, 16, 23, 42]]
    expected = LLMEngine(llama_path, max_model_len=64).generate(prompt, GREEDY, use_tqdm=False)[0].token_ids
    assert LLMEngine(str(path), max_model_len=64).generate(prompt, GREEDY, use_tqdm=False)[0].token_ids == expected


def test_missing_tensor_is_named(llama_path, tmp_path):
    path = rewrite(llama_path, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks: \['model.layers.1.mlp.gate_up_proj.weight \(shard 1\)'\]"):
        LLMEngine(path)


def test_unexpected_tensor_is_named(llama_path, tmp_path):
    path = rewrite(llama_path, tmp_path / "m", lambda t: t.update({"model.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match="'model.extra.weight'.*no parameter"):
        LLMEngine(path)


def test_misshaped_tensor_names_both_shapes(llama_path, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.randn(16, 64)
    path = rewrite(llama_path, tmp_path / "m", edit)
    with pytest.raises(ValueError, match=r"k_proj.weight' has shape \(16, 64\) but .* expects \(32, 64\)"):
        LLMEngine(path)


def test_fp16_checkpoint_into_bf16_is_value_converted():
    x = torch.tensor([1.0, -2.5, 65504.0, 1e-3], dtype=torch.float16)
    y = convert_dtype(x, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), x.float(), rtol=1e-2, atol=0)  # a bit view would be garbage
    assert not torch.equal(x.view(torch.bfloat16).float(), y.float())


def test_same_width_other_formats_are_bit_viewed():
    x = torch.tensor([0.5, -3.0], dtype=torch.float8_e4m3fn)
    y = convert_dtype(x, torch.float8_e5m2)
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))
    assert convert_dtype(torch.tensor([1.5]), torch.bfloat16).item() == 1.5  # other widths: .to()
