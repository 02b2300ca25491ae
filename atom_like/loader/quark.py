"""Quark-quantized checkpoints (`quantization_config.quant_method: "quark"`): which layers are MXFP4.

The config alone decides, per checkpoint module name, in Quark's order (and vLLM's / ATOM's):
  1. `exclude` -> unquantized. An entry is an exact name, `re:<regex>` (re.match: anchored at the
     start only, as vLLM and ATOM read it) or an fnmatch glob such as `*self_attn*` (what Quark's
     templates write; its exporter expands them into exact names).
  2. the first `layer_quant_config` pattern (fnmatch) matching the name,
  3. `layer_type_quant_config["Linear"]` (every layer here is a Linear in Quark's eyes),
  4. `global_quant_config`.
The chosen layer config must be OCP MXFP4 as AMD releases it: `weight` fp4, per_group, group_size
32, e8m0 scales, static; `input_tensors` either absent (W4A16) or the same format, dynamic, with
the "even" scale rule (W4A4); no `output_tensors` (except the fp8 KV-cache spec of the
`kv_cache_group` layers) and no `bias` quantization. Anything else is refused, naming the field.
A layer config replaces the global one as a whole (vLLM's reading; Quark's docs speak of a
fallback per tensor, which no exported config we know of relies on).

Names are the checkpoint's (HF module names). A merged layer of the engine (q_a + kv_a, gate + up)
is quantized when each of its checkpoint projections is, and the projections must agree; so must
the 3 x E per-expert projections of a layer's routed experts. The router, embeddings and lm_head
are never quantizable here (vLLM treats them the same way); a packed tensor for them is refused
by the loader. MLA's kv_b_proj must stay unquantized: attention absorbs its weight as a matrix.

A MoE block's shared expert whose layers the config gives the routed experts' scheme is stored and
run as one more routed expert (fuse_shared_experts_by_format, SGLang's shared-experts fusion); any
other mix keeps it a separate MLP.
"""
from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn
from transformers import PretrainedConfig

from atom_like.loader.weights import WeightMap
from model_ops.attention.mla import MLAAttention
from model_ops.linear import Linear, MergedLinear
from model_ops.moe import FusedExperts, SharedExpertHost
from model_ops.quant.mxfp4_layers import MXFP4Experts, MXFP4Linear, MXFP4MergedLinear, mxfp4_experts_backend

logger = logging.getLogger(__name__)

ActivationsMode = Literal["checkpoint", "unquantized"]
ACTIVATION_MODES = ("checkpoint", "unquantized")
_FIELD = "quantization_config"
_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class MXFP4Scheme:
    """A layer with MXFP4 weights; `quantize_activations`: its GEMM inputs are MXFP4-QDQ'd too."""

    quantize_activations: bool


def _matches(entry: str, name: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    if _GLOB.search(entry):
        return fnmatch.fnmatchcase(name, entry)
    return entry == name


def _check_mx_tensor(spec: dict, where: str, dynamic: bool) -> None:
    """`spec` must be OCP MXFP4 (fp4 E2M1 elements, one e8m0 scale per 32 along the input dim)."""
    if isinstance(spec, list):
        raise ValueError(f"{_FIELD}.{where} is a list of {len(spec)} specs (a two-level scheme such as NVFP4 or "
                         "w4a8): not supported; atom_like loads OCP MXFP4 (fp4, per_group 32, e8m0)")
    if not isinstance(spec, dict):
        raise ValueError(f"{_FIELD}.{where} must be a dict or null; got {spec!r}")
    expected = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0",
                "is_dynamic": dynamic}
    if spec.get("ch_axis", -1) not in (-1, None):
        expected["ch_axis"] = -1
    for key, value in expected.items():
        if spec.get(key) != value:
            raise ValueError(f"{_FIELD}.{where}.{key} is {spec.get(key)!r}; atom_like loads only OCP MXFP4 "
                             f"(dtype fp4, qscheme per_group, group_size 32, scale_format e8m0, "
                             f"{'dynamic' if dynamic else 'static'}), which needs {key} {value!r}")
    if dynamic and spec.get("scale_calculation_mode", "even") != "even":
        raise ValueError(f"{_FIELD}.{where}.scale_calculation_mode is {spec.get('scale_calculation_mode')!r}; "
                         "the MXFP4 activation quantization implemented is Quark's 'even' rule")


def _check_fp8_kv(spec: Any, where: str) -> None:
    if not isinstance(spec, dict) or spec.get("dtype") != "fp8_e4m3" or spec.get("qscheme") != "per_tensor":
        got = spec.get("dtype") if isinstance(spec, dict) else spec
        raise ValueError(f"{_FIELD}.{where} must be fp8_e4m3 per_tensor (static per-tensor KV-cache scales); "
                         f"got {got!r}")


class QuarkConfig:
    """A parsed Quark `quantization_config`; `scheme(names)` decides a layer."""

    def __init__(self, raw: dict):
        self.raw = raw
        method = raw.get("quant_method")
        if method != "quark":
            raise ValueError(f"{_FIELD}.quant_method {method!r} is not supported; atom_like loads Quark MXFP4 "
                             "checkpoints (quant_method 'quark')")
        export = raw.get("export") or {}
        if export.get("weight_format", "real_quantized") != "real_quantized":
            raise ValueError(f"{_FIELD}.export.weight_format {export.get('weight_format')!r} is not supported "
                             "(only real_quantized: packed weights)")
        if raw.get("softmax_quant_spec") is not None:
            raise ValueError(f"{_FIELD}.softmax_quant_spec is set: quantized attention softmax is not supported")
        exclude = raw.get("exclude") or []
        if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
            raise ValueError(f"{_FIELD}.exclude must be a list of names / 're:' regexes / globs; got {exclude!r}")
        for entry in exclude:
            if entry.startswith("re:"):
                try:
                    re.compile(entry[3:])
                except re.error as e:
                    raise ValueError(f"{_FIELD}.exclude entry {entry!r} is not a valid regex: {e}") from None
        # exact names (Quark's exporter writes hundreds) by set lookup; regexes and globs one by one
        self.exclude_names = {e for e in exclude if not e.startswith("re:") and not _GLOB.search(e)}
        self.exclude_patterns = [e for e in exclude if e not in self.exclude_names]
        self.global_config: dict = raw.get("global_quant_config") or {}
        self.layer_configs: dict[str, dict] = raw.get("layer_quant_config") or {}
        self.type_configs: dict[str, dict] = raw.get("layer_type_quant_config") or {}
        for type_name in self.type_configs:
            if type_name != "Linear":
                raise ValueError(f"{_FIELD}.layer_type_quant_config[{type_name!r}]: only Linear layers are "
                                 "quantizable here")
        self.kv_cache_group: list[str] = list(export.get("kv_cache_group") or [])
        for pattern, layer in (raw.get("kv_cache_quant_config") or {}).items():
            _check_fp8_kv((layer or {}).get("output_tensors"), f"kv_cache_quant_config[{pattern!r}].output_tensors")
        self._schemes: dict[tuple[str, ...], MXFP4Scheme | None] = {}

    @classmethod
    def from_model_config(cls, config: PretrainedConfig) -> "QuarkConfig | None":
        """The checkpoint's quantization_config (top level, or a wrapper's text_config), or None."""
        for cfg in (config, config.get_text_config()):
            raw = getattr(cfg, _FIELD, None)
            if raw is not None:
                return cls(raw if isinstance(raw, dict) else raw.to_dict())
        return None

    def _layer_config(self, name: str) -> tuple[dict, str]:
        for pattern, layer in self.layer_configs.items():
            if _matches(pattern, name):
                return layer, f"layer_quant_config[{pattern!r}]"
        if "Linear" in self.type_configs:
            return self.type_configs["Linear"], "layer_type_quant_config['Linear']"
        return self.global_config, "global_quant_config"

    def _scheme_of(self, name: str, aliases: Iterable[str]) -> MXFP4Scheme | None:
        names = (name, *aliases)
        if names in self._schemes:
            return self._schemes[names]
        if any(n in self.exclude_names for n in names) or any(
                _matches(entry, n) for entry in self.exclude_patterns for n in names):
            scheme = None
        else:
            layer, where = self._layer_config(name)
            if layer.get("bias") is not None:
                raise ValueError(f"{_FIELD}.{where}.bias is set (for {name}): quantized biases are not supported")
            if layer.get("output_tensors") is not None:
                if not any(_matches(p, n) for p in self.kv_cache_group for n in names):
                    raise ValueError(f"{_FIELD}.{where}.output_tensors is set (for {name}): quantized GEMM outputs "
                                     "are not supported (only the fp8 KV-cache scales of export.kv_cache_group layers)")
                _check_fp8_kv(layer["output_tensors"], f"{where}.output_tensors")
            weight = layer.get("weight")
            if weight is None:
                scheme = None
            else:
                _check_mx_tensor(weight, f"{where}.weight", dynamic=False)
                inputs = layer.get("input_tensors")
                if inputs is not None:
                    _check_mx_tensor(inputs, f"{where}.input_tensors", dynamic=True)
                scheme = MXFP4Scheme(quantize_activations=inputs is not None)
        self._schemes[names] = scheme
        return scheme

    def scheme(self, names: Sequence[str], aliases: dict[str, list[str]]) -> MXFP4Scheme | None:
        """The one scheme of a layer made of the checkpoint modules `names` (`aliases[name]`: other
        names the config may use for the same module); their configs must agree."""
        schemes = [self._scheme_of(n, aliases.get(n, ())) for n in names]
        for n, s in zip(names[1:], schemes[1:]):
            if s != schemes[0]:
                raise ValueError(f"{_FIELD} quantizes {names[0]} as {_scheme_name(schemes[0])} but {n} as "
                                 f"{_scheme_name(s)}; both are one layer here and must share a scheme")
        return schemes[0]


def _scheme_name(scheme: MXFP4Scheme | None) -> str:
    if scheme is None:
        return "unquantized"
    return "MXFP4 (W4A4)" if scheme.quantize_activations else "MXFP4 (W4A16)"


def _aliases(name: str, weight_map: WeightMap) -> list[str]:
    return [alt + name[len(prefix):] for prefix, alt in weight_map.config_aliases if name.startswith(prefix)]


def _checkpoint_names(path: str, module: nn.Module, merged_shards: dict[str, list[str]]) -> list[str]:
    """The checkpoint module names the engine module at `path` is loaded from."""
    parent, _, leaf = path.rpartition(".")
    if isinstance(module, FusedExperts):
        return [f"{path}.{shard}" for param in ("w13", "w2") for shard in module.weight_shards(param)]
    if isinstance(module, MergedLinear) and leaf in merged_shards:
        return [f"{parent}.{name}" if parent else name for name in merged_shards[leaf]]
    return [path]


def quantize_model(model: nn.Module, quark: QuarkConfig, weight_map: WeightMap,
                   activations: ActivationsMode = "checkpoint", moe_backend: str = "auto",
                   fuse_shared_experts: bool = True) -> dict[str, MXFP4Scheme]:
    """Swap every Linear and routed-expert layer the config quantizes for its MXFP4 module (built
    before the weights are loaded; see model_ops.deferred). `activations="unquantized"` runs the
    same weights with unquantized activations (W4A16); `moe_backend` is --moe-backend, the kernel
    of the MXFP4 routed experts; `fuse_shared_experts` (--fuse-shared-experts) lets a shared
    expert of the routed experts' format run as one of them (fuse_shared_experts below).
    Returns {module path: scheme}."""
    if activations not in ACTIVATION_MODES:
        raise ValueError(f"--mxfp4-activations must be one of {', '.join(ACTIVATION_MODES)}; got {activations!r}")
    merged_shards: dict[str, list[str]] = {}
    for ckpt_module, (merged, shard) in sorted(weight_map.packed.items(), key=lambda kv: kv[1][1]):
        merged_shards.setdefault(merged, []).append(ckpt_module)
    schemes: dict[str, MXFP4Scheme | None] = {}
    for path, module in model.named_modules():
        if isinstance(module, (Linear, FusedExperts)):
            names = _checkpoint_names(path, module, merged_shards)
            scheme = quark.scheme(names, {n: _aliases(n, weight_map) for n in names})
            if scheme is not None and activations == "unquantized":
                scheme = MXFP4Scheme(quantize_activations=False)
            schemes[path] = scheme
    fused = fuse_shared_experts_by_format(model, schemes, moe_backend) if fuse_shared_experts else 0
    plan: dict[str, MXFP4Scheme] = {}
    unquantized = 0
    for path, module in list(model.named_modules()):
        if not isinstance(module, (Linear, FusedExperts)):
            continue
        scheme = schemes[path]  # a fused block's experts keep their path, and the shared expert's scheme
        if scheme is None:
            unquantized += 1
            continue
        parent_path, _, leaf = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        name = _checkpoint_names(path, module, merged_shards)[0]
        if isinstance(parent, MLAAttention) and module is parent.kv_b_proj:
            raise ValueError(f"{_FIELD} quantizes {name} (MLA kv_b_proj): not supported, attention absorbs "
                             "its weight as a matrix; exclude it (Quark's templates exclude *self_attn*)")
        try:
            setattr(parent, leaf, _packed_module(module, scheme, moe_backend))
        except ValueError as e:
            raise ValueError(f"{_FIELD} quantizes {name}, which cannot be MXFP4: {e}") from None
        plan[path] = scheme
    experts = sum(isinstance(model.get_submodule(p), MXFP4Experts) for p in plan)
    logger.info("Quark MXFP4: %d routed-expert layer(s) (the shared expert fused in as one more expert in %d) and "
                "%d Linear layer(s) packed, %d Linear layer(s) unquantized; activations %s", experts, fused,
                len(plan) - experts, unquantized, _activation_note(plan.values(), activations))
    return plan


def fuse_shared_experts_by_format(model: nn.Module, schemes: dict[str, MXFP4Scheme | None], moe_backend: str) -> int:
    """Fuse each MoE block's shared expert into its routed experts (model_ops.moe.SharedExpertHost)
    where the config gives the routed experts and every layer of the shared expert one MXFP4
    scheme (same weight and activation quantization): decided by the config alone, per block.
    A float shared expert beside MXFP4 routed ones (an exclude list naming it), or one of another
    activation scheme, keeps its own layers. Float routed experts are never fused here (no
    quantization config, no call). aiter's routed experts stay unfused: its adapter (never run on
    AMD hardware) is not built for the extra expert. Before any packed weight exists, so the
    packed experts are allocated once, with E + 1 experts. Returns how many blocks were fused."""
    paths = {module: path for path, module in model.named_modules()}
    fused = 0
    for block in [m for m in model.modules() if isinstance(m, SharedExpertHost)]:
        parts = block.fusable_shared_expert()
        if parts is None:
            continue
        experts, layers = parts
        scheme = schemes[paths[experts]]
        if scheme is None or any(schemes[paths[layer]] != scheme for layer in layers):
            continue
        hidden = experts.w13.shape[-1]
        if mxfp4_experts_backend(moe_backend, hidden, experts.sharding.size, scheme.quantize_activations) == "aiter":
            continue
        block.fuse_shared_expert()
        fused += 1
    return fused


def checkpoint_quantizer(config: PretrainedConfig, activations: ActivationsMode, moe_backend: str = "auto",
                         fuse_shared_experts: bool = True) -> Callable[[nn.Module], object] | None:
    """build_model's `quantize` for a checkpoint with this config: None unless it is Quark-quantized."""
    quark = QuarkConfig.from_model_config(config)
    if quark is None:
        return None
    return lambda model: quantize_model(model, quark, model.weight_map(), activations, moe_backend,
                                        fuse_shared_experts)


def _activation_note(schemes: Iterable[MXFP4Scheme], activations: ActivationsMode) -> str:
    if activations == "unquantized":
        return "unquantized (--mxfp4-activations unquantized: W4A16)"
    if any(s.quantize_activations for s in schemes):
        return "MXFP4-quantized per the checkpoint's input_tensors (W4A4)"
    return "unquantized (the checkpoint has no input_tensors quantization: W4A16)"


def _packed_module(module: nn.Module, scheme: MXFP4Scheme, moe_backend: str) -> nn.Module:
    """The packed counterpart of `module`, split across tensor-parallel ranks as it is."""
    qa = scheme.quantize_activations
    if isinstance(module, FusedExperts):
        hidden = module.w13.shape[-1]
        return MXFP4Experts(module.num_experts, hidden, module.sharding.full, qa, moe_backend)
    bias = module.bias is not None
    if isinstance(module, MergedLinear):
        return MXFP4MergedLinear(module.in_features, module.output_sizes, bias, qa, module.sharding)
    return MXFP4Linear(module.in_features, module.out_features, bias, qa, module.sharding)
