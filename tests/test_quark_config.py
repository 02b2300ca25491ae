"""Which layers a Quark quantization_config makes MXFP4: exclude semantics (exact names, `re:`
regexes with re.match, Quark's fnmatch globs), layer_quant_config / layer_type_quant_config /
global precedence, merged layers, name aliases of the Kimi wrapper, and refused schemes."""
from __future__ import annotations

import copy

import pytest

from atom_like.loader.quark import MXFP4Scheme, QuarkConfig
from atom_like.zoo.quark_mxfp4 import EXCLUDES, quantization_config

W4A4, W4A16 = MXFP4Scheme(True), MXFP4Scheme(False)


def config(exclude=(), **edits) -> QuarkConfig:
    raw = quantization_config(list(exclude))
    for key, value in edits.items():
        raw[key] = value
    return QuarkConfig(raw)


def scheme(cfg: QuarkConfig, *names: str, aliases=None):
    return cfg.scheme(list(names), aliases or {})


@pytest.mark.parametrize("entry,name,excluded", [
    ("model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.q_a_proj", True),
    ("model.layers.0.self_attn.q_a_proj", "model.layers.10.self_attn.q_a_proj", False),  # exact, not a prefix
    ("*self_attn*", "model.layers.3.self_attn.kv_b_proj", True),
    ("*mlp.gate", "model.layers.3.mlp.gate_proj", False),  # fnmatch matches the whole name
    ("*mlp.gate_proj", "model.layers.0.mlp.gate_proj", True),
    ("*mlp.gate_proj", "model.layers.3.mlp.experts.0.gate_proj", False),
    ("*shared_experts*", "model.layers.3.mlp.shared_experts.down_proj", True),
    ("re:.*mlp.gate", "model.layers.3.mlp.gate_proj", True),  # re.match: anchored at the start only (vLLM)
    ("re:mlp", "model.layers.3.mlp.gate_proj", False),
    (r"re:.*\.experts\.\d+\.down_proj$", "model.layers.3.mlp.experts.17.down_proj", True),
])
def test_exclude_entry_semantics(entry, name, excluded):
    assert scheme(config([entry]), name) == (None if excluded else W4A4)


@pytest.mark.parametrize("style,name,quantized", [
    ("released", "model.layers.0.mlp.down_proj", True),
    ("released", "model.layers.1.mlp.shared_experts.gate_proj", True),
    ("released", "model.layers.1.mlp.experts.3.up_proj", True),
    ("released", "model.layers.1.self_attn.o_proj", False),
    ("experts_only", "model.layers.0.mlp.down_proj", False),
    ("experts_only", "model.layers.1.mlp.shared_experts.gate_proj", False),
    ("experts_only", "model.layers.1.mlp.experts.3.up_proj", True),
])
def test_both_released_exclude_styles(style, name, quantized):
    assert (scheme(config(EXCLUDES[style]), name) is not None) == quantized


def test_precedence_exclude_then_layer_then_type_then_global():
    raw = quantization_config([])
    w4a16 = copy.deepcopy(raw["global_quant_config"])
    w4a16["input_tensors"] = None
    unquantized = dict(w4a16, weight=None)
    raw["layer_quant_config"] = {"*down_proj": w4a16, "*o_proj": w4a16}
    raw["layer_type_quant_config"] = {"Linear": unquantized}
    raw["exclude"] = ["*o_proj"]
    cfg = QuarkConfig(raw)
    assert scheme(cfg, "model.layers.1.mlp.experts.0.down_proj") == W4A16  # layer pattern
    assert scheme(cfg, "model.layers.1.self_attn.o_proj") is None  # exclude wins over the pattern
    assert scheme(cfg, "model.layers.1.mlp.experts.0.up_proj") is None  # type config (weight null) over global
    raw["layer_type_quant_config"] = {}
    assert scheme(QuarkConfig(raw), "model.layers.1.mlp.experts.0.up_proj") == W4A4  # global


def test_merged_projections_must_agree():
    cfg = config(["*up_proj"])
    assert scheme(cfg, "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj") == W4A4
    with pytest.raises(ValueError, match=r"quantizes model.layers.0.mlp.gate_proj as MXFP4 \(W4A4\) but "
                                         r"model.layers.0.mlp.up_proj as unquantized"):
        scheme(cfg, "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")


def test_aliases_let_a_config_name_the_text_model():
    """Kimi: the engine's language_model.model.* modules, named model.* in the config (ATOM #732)."""
    cfg = config(["model.layers.1.mlp.shared_experts.gate_proj"])
    name = "language_model.model.layers.1.mlp.shared_experts.gate_proj"
    assert scheme(cfg, name) == W4A4
    assert scheme(cfg, name, aliases={name: ["model.layers.1.mlp.shared_experts.gate_proj"]}) is None


def test_from_model_config_reads_the_wrapper_or_its_text_config():
    from transformers import DeepseekV3Config, Kimi_K25Config

    raw = quantization_config(EXCLUDES["released"])
    assert QuarkConfig.from_model_config(DeepseekV3Config()) is None
    assert QuarkConfig.from_model_config(DeepseekV3Config(quantization_config=raw)).raw == raw
    kimi = Kimi_K25Config(text_config={"quantization_config": raw})
    assert QuarkConfig.from_model_config(kimi).raw == raw


def _edit_weight(**fields):
    raw = quantization_config([])
    raw["global_quant_config"]["weight"].update(fields)
    return raw


def _edit_inputs(**fields):
    raw = quantization_config([])
    raw["global_quant_config"]["input_tensors"].update(fields)
    return raw


def _set(path: tuple, value):
    raw = quantization_config([])
    target = raw
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return raw


@pytest.mark.parametrize("raw,match", [
    (_edit_weight(dtype="int4"), r"global_quant_config.weight.dtype is 'int4'"),
    (_edit_weight(dtype="fp6_e3m2"), r"weight.dtype is 'fp6_e3m2'"),  # MXFP6
    (_edit_weight(dtype="fp8_e4m3", qscheme="per_tensor", group_size=None), r"weight.dtype is 'fp8_e4m3'"),
    (_edit_weight(group_size=16), r"weight.group_size is 16"),
    (_edit_weight(scale_format="float"), r"weight.scale_format is 'float'"),
    (_edit_weight(ch_axis=0), r"weight.ch_axis is 0"),
    (_set(("global_quant_config", "weight"), [{"dtype": "fp4"}, {"dtype": "fp8_e4m3"}]), r"weight is a list of 2"),
    (_edit_inputs(dtype="fp8_e4m3", is_dynamic=False, qscheme="per_tensor"), r"input_tensors.dtype is 'fp8_e4m3'"),
    (_edit_inputs(is_dynamic=False), r"input_tensors.is_dynamic is False"),
    (_edit_inputs(scale_calculation_mode="floor"), r"input_tensors.scale_calculation_mode is 'floor'"),
    (_set(("global_quant_config", "output_tensors"), {"dtype": "fp8_e4m3", "qscheme": "per_tensor"}),
     r"global_quant_config.output_tensors is set .*quantized GEMM outputs"),
    (_set(("global_quant_config", "bias"), {"dtype": "fp4"}), r"global_quant_config.bias is set"),
])
def test_unsupported_layer_schemes_are_refused_naming_the_field(raw, match):
    with pytest.raises(ValueError, match=match):
        scheme(QuarkConfig(raw), "model.layers.1.mlp.experts.0.up_proj")


@pytest.mark.parametrize("raw,match", [
    (_set(("quant_method",), "fp8"), r"quant_method 'fp8' is not supported"),
    (_set(("export", "weight_format"), "fake_quantized"), r"weight_format 'fake_quantized'"),
    (_set(("layer_type_quant_config",), {"Conv2d": {}}), r"layer_type_quant_config\['Conv2d'\]"),
    (_set(("exclude",), ["re:(unclosed"]), r"exclude entry 're:\(unclosed' is not a valid regex"),
    (_set(("kv_cache_quant_config",), {"*k_proj": {"output_tensors": {"dtype": "int8", "qscheme": "per_tensor"}}}),
     r"kv_cache_quant_config\['\*k_proj'\].output_tensors must be fp8_e4m3 per_tensor"),
])
def test_unsupported_configs_are_refused_at_parse(raw, match):
    with pytest.raises(ValueError, match=match):
        QuarkConfig(raw)


def test_kv_cache_group_layers_may_carry_the_fp8_output_spec():
    raw = quantization_config([], kv_cache=True)
    cfg = QuarkConfig(raw)
    assert scheme(cfg, "model.layers.1.self_attn.kv_b_proj") == W4A4  # its layer config: fp4 weight + fp8 output
    assert scheme(QuarkConfig(quantization_config(["*self_attn*"], kv_cache=True)),
                  "model.layers.1.self_attn.kv_b_proj") is None  # exclude wins, as in Quark's export


def test_kimi_config_may_name_modules_in_any_layout():
    """The engine's language_model.model.* modules, excluded under the text model's own names
    (model.*), transformers' in-memory names (model.language_model.*) or save_pretrained's
    (language_model.model.blocks.*): each alias is honoured, nothing else is excluded."""
    from conftest import TINY_DEEPSEEK
    from transformers import DeepseekV3Config

    from atom_like.loader.quark import quantize_model
    from atom_like.loader.weights import _map_name
    from atom_like.models.kimi_k25 import KimiK25ForConditionalGeneration
    from model_ops.deferred import deferred_weights
    from model_ops.linear import MergedLinear
    from model_ops.quant.mxfp4_layers import MXFP4MergedLinear

    shared = "mlp.shared_experts"
    exclude = [f"model.layers.1.{shared}.gate_proj", f"model.layers.1.{shared}.up_proj",
               f"model.language_model.layers.2.{shared}.gate_proj", f"model.language_model.layers.2.{shared}.up_proj",
               "*self_attn*", "*mlp.gate_proj", "*mlp.up_proj"]
    config = DeepseekV3Config(**{**TINY_DEEPSEEK, "num_hidden_layers": 4})
    with deferred_weights():
        model = KimiK25ForConditionalGeneration(config)
        quantize_model(model, config_with(exclude), model.weight_map())
    layers = model.language_model.model.layers
    packed = [layers[i].mlp.shared_experts.gate_up_proj for i in (1, 2)]
    assert not any(isinstance(m, MXFP4MergedLinear) for m in packed)
    assert all(isinstance(m, MergedLinear) for m in packed)
    # layer 3's shared expert is MXFP4 like its routed experts: fused into them as expert E
    assert layers[3].mlp.shared_experts is None and layers[3].mlp.shared_slot == config.n_routed_experts
    wm, name = model.weight_map(), "language_model.model.layers.{}.mlp.shared_experts.down_proj.weight"
    slot = f"{config.n_routed_experts}.down_proj"
    assert _map_name(name.format(3), wm) == ("language_model.model.layers.3.mlp.experts.w2", slot)
    assert _map_name(name.format(1), wm) == (name.format(1), None)  # its own down_proj, per layer
    with deferred_weights():
        model = KimiK25ForConditionalGeneration(config)
        blocks = [e.replace("model.language_model.layers.", "language_model.model.blocks.") for e in exclude]
        quantize_model(model, config_with(blocks), model.weight_map())
    assert isinstance(model.language_model.model.layers[2].mlp.shared_experts.gate_up_proj, MergedLinear)


def config_with(exclude: list[str]) -> QuarkConfig:
    return QuarkConfig(quantization_config(exclude))
