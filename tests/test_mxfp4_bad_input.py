"""A Quark MXFP4 / fp8-KV checkpoint that is wrong in one place is refused at load, naming the
tensor, the field or the flag; packed bytes never reach a float parameter."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atom_like import LLMEngine
from atom_like.zoo.quark_mxfp4 import convert

EXPERT = "model.layers.1.mlp.experts.3.down_proj"
SHARED = "model.layers.2.mlp.shared_experts.up_proj"


@pytest.fixture(scope="module")
def mxfp4(make_deepseek, tmp_path_factory) -> str:
    return str(convert(make_deepseek("v3"), tmp_path_factory.mktemp("mxfp4_bad"), style="released"))


def edited(src: str, dst, tensors=None, config=None) -> str:
    path = shutil.copytree(src, dst)
    if tensors is not None:
        t = load_file(str(path / "model.safetensors"))
        tensors(t)
        save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        c = json.loads((path / "config.json").read_text())
        config(c)
        (path / "config.json").write_text(json.dumps(c))
    return str(path)


def _nan_scale(t):
    t[f"{EXPERT}.weight_scale"][5, 0] = 255


def _pop(t, name):
    t.pop(name)


def _weight(c, **fields):
    c["quantization_config"]["global_quant_config"]["weight"].update(fields)


def _exclude_more(c, entry):
    c["quantization_config"]["exclude"].append(entry)


CASES = {
    "int4": (None, lambda c: _weight(c, dtype="int4"), r"global_quant_config.weight.dtype is 'int4'"),
    "mxfp6": (None, lambda c: _weight(c, dtype="fp6_e2m3"), r"weight.dtype is 'fp6_e2m3'"),
    "fp8 weights": (None, lambda c: _weight(c, dtype="fp8_e4m3", qscheme="per_channel"), r"weight.dtype is 'fp8_e4m3'"),
    "not quark": (None, lambda c: c["quantization_config"].update(quant_method="gptq"), r"quant_method 'gptq'"),
    "scale shape": (lambda t: t.update({f"{EXPERT}.weight_scale": t[f"{EXPERT}.weight_scale"][:, :0]}), None,
                    rf"'{EXPERT}.weight_scale' has shape \(64, 0\) but .* expects \(64, 1\)"),
    "missing scale": (lambda t: _pop(t, f"{SHARED}.weight_scale"), None,
                      # the shared expert is fused into the routed experts as expert 8 (of 8 routed)
                      r"lacks: \['model.layers.2.mlp.experts.w13_scale \(shard 8.up_proj\)'\]"),
    "missing expert scale": (lambda t: _pop(t, f"{EXPERT}.weight_scale"), None,
                             r"model.layers.1.mlp.experts.w2_scale \(shard 3.down_proj\)"),
    "nan scale": (_nan_scale, None, rf"'{EXPERT}.weight_scale' holds the E8M0 NaN byte 255 at index \(5, 0\)"),
    # the config says bf16, the checkpoint is packed: never loaded as floats
    "packed but excluded": (None, lambda c: _exclude_more(c, "*shared_experts*"),
                            r"'model.layers.\d.mlp.shared_experts.\w+_proj.weight' is torch.uint8 but .* is "
                            r"torch.float32: integer \(e.g. packed MXFP4\) and float tensors are never converted"),
    "float but quantized": (lambda t: t.update({f"{EXPERT}.weight": torch.randn(64, 32)}), None,
                            rf"'{EXPERT}.weight' is torch.float32 but w2 holds packed MXFP4 bytes"),
    "kv_b_proj": (None, lambda c: c["quantization_config"].update(exclude=["*q_a_proj", "*q_b_proj",
                  "*kv_a_proj_with_mqa", "*o_proj", "*lm_head"]), r"kv_b_proj\): not supported"),
    # q_b_proj reads the 24-wide q LoRA
    "block multiple": (None, lambda c: c["quantization_config"].update(exclude=["*kv_b_proj", "*lm_head"]),
                       r"quantizes model.layers.0.self_attn.q_b_proj, which cannot be MXFP4: MXFP4 input size 24 "
                       "is not a multiple of 32"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_mxfp4_checkpoint_is_named(mxfp4, tmp_path, case):
    tensors, config, match = CASES[case]
    path = edited(mxfp4, tmp_path / "bad", tensors, config)
    with pytest.raises(ValueError, match=match):
        LLMEngine(path, max_model_len=64)


def test_packed_bytes_are_never_converted_to_floats():
    from atom_like.loader.weights import convert_dtype

    for src, dst in ((torch.uint8, torch.bfloat16), (torch.uint8, torch.float32), (torch.bfloat16, torch.uint8)):
        with pytest.raises(ValueError, match="never converted"):
            convert_dtype(torch.zeros(4, dtype=src), dst)


def test_quantization_config_on_a_float_checkpoint_is_refused(make_deepseek, tmp_path):
    """A float checkpoint whose config claims MXFP4 (packed bytes expected, floats found)."""
    from atom_like.zoo.quark_mxfp4 import EXCLUDES, quantization_config

    path = edited(make_deepseek("v3"), tmp_path / "f",
                  config=lambda c: c.update(quantization_config=quantization_config(EXCLUDES["released"])))
    with pytest.raises(ValueError, match=r"is torch.float32 but (w13|w2|weight) holds packed MXFP4 bytes"):
        LLMEngine(path, max_model_len=64)


@pytest.mark.parametrize("value,match", [(0.0, "scale of 0.0"), (-1.0, "scale of -1.0"),
                                         (float("nan"), "scale of nan")])
def test_non_positive_kv_scale_is_named(mxfp4, tmp_path, value, match):
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.output_scale"
    path = edited(mxfp4, tmp_path / "kv", tensors=lambda t: t.update({name: torch.tensor(value)}))
    with pytest.raises(ValueError, match=rf"'{name}' is a KV-cache {match}"):
        LLMEngine(path, max_model_len=64, kv_cache_dtype="fp8")


@pytest.mark.parametrize("flag,match", [(dict(kv_cache_dtype="fp8_e5m2"), "--kv-cache-dtype must be one of auto, fp8"),
                                        (dict(kv_cache_dtype="int8"), "--kv-cache-dtype"),
                                        (dict(mxfp4_activations="bf16"), "--mxfp4-activations must be one of")])
def test_bad_flags_are_named(mxfp4, flag, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(mxfp4, max_model_len=64, **flag)
