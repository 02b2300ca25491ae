"""EngineArgs (one dataclass for every entry point, CLI and Python) and model-config helpers.

Checkpoint configs are read through transformers.AutoConfig, which also folds the older
`rope_theta` + `rope_scaling` spelling into transformers-5 `rope_parameters`; everything here
reads the normalised form.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from atom_like.loader.dummy import LOAD_FORMATS
from atom_like.loader.quark import ACTIVATION_MODES
from atom_like.models.config_aliases import register_config_aliases
from kernels_rocm.aiter_ops import detect_platform
from model_ops.attention.backends import check_aiter_available, check_backend_choice
from model_ops.quant.fp8 import fp8_kv_dtype
from spec_decode.adaptive import MAX_DRAFTS

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 = fp8_e4m3 (vLLM's and ATOM's spelling)


@dataclass
class EngineArgs:
    model: str | None = field(default=None, metadata={"help": "Checkpoint folder (HF layout: config.json + *.safetensors)."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer folder (default: --model)."})
    load_format: str = field(default="auto", metadata={"help": "auto: read the checkpoint's *.safetensors | dummy: build the model (and the draft) from config.json alone, every weight seeded random (benchmarks at a real model's size without its files; the output is meaningless)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom code in the checkpoint's config."})
    dtype: str = field(default="auto", metadata={"help": "auto | bfloat16 | float16 | float32 (auto: float32 on CPU, the checkpoint's half type on GPU)."})
    device: str = field(default="auto", metadata={"help": "auto | cuda | cpu (ROCm GPUs are 'cuda' in torch)."})
    tensor_parallel_size: int = field(default=1, metadata={"help": "Tensor-parallel ranks: one process and one GPU each (gloo processes on CPU); see docs/parallel.md.", "short": "-tp"})
    disable_custom_all_reduce: bool = field(default=False, metadata={"help": "With -tp on NVIDIA GPUs of one host, all-reduces up to 1 MiB (decode's activations) run as one kernel over peer memory (torch symmetric memory) instead of NCCL (6.7 against 11.9 us for 8 KiB on two H200s); this flag keeps NCCL for every collective."})
    fuse_all_reduce_norm: bool = field(default=True, metadata={"help": "With the custom all-reduce (above), the all-reduce that ends a decoder layer's attention or MLP runs in one kernel with the residual add and RMSNorm after it (one cross-GPU barrier, no separate norm launch; same bits at two ranks). --no-fuse-all-reduce-norm keeps them apart (A/B measurements)."})
    block_size: int = field(default=16, metadata={"help": "Tokens per KV-cache block."})
    max_num_seqs: int = field(default=256, metadata={"help": "Most sequences in one step."})
    max_num_batched_tokens: int = field(default=8192, metadata={"help": "Most query tokens in one step (longer prompts are prefilled in chunks)."})
    max_model_len: int | None = field(default=None, metadata={"help": "Longest prompt + output (default: the model's max_position_embeddings)."})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "Fraction of GPU memory the engine may use (weights, activations, KV cache)."})
    num_kv_blocks: int | None = field(default=None, metadata={"help": "KV-cache blocks, overriding the automatic size."})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "KV-cache dtype: auto (= model dtype) | fp8 | fp8_e4m3 (e4m3 with per-tensor scales from the checkpoint, else 1.0; e4m3fnuz on MI300, e4m3fn elsewhere)."})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "Reuse the KV of prompt prefixes earlier requests computed (--no-enable-prefix-caching: recompute every prompt)."})
    mxfp4_activations: str = field(default="checkpoint", metadata={"help": "MXFP4 (Quark) checkpoints: checkpoint = quantize GEMM inputs to MXFP4 as the checkpoint's input_tensors say (W4A4); unquantized = same weights, activations in the model dtype (W4A16)."})
    enforce_eager: bool = field(default=False, metadata={"help": "Never use CUDA/HIP graphs."})
    overlap_scheduling: bool = field(default=True, metadata={"help": "Schedule and prepare step N+1 while the GPU runs step N (vLLM's async scheduling, SGLang's overlap scheduler); --no-overlap-scheduling: one step at a time. Same tokens either way."})
    attention_backend: str = field(default="auto", metadata={"help": "auto | torch | triton | aiter (auto: the torch reference on CPU; on a GPU aiter's MLA decode where it runs (ROCm gfx942/gfx950, aiter importable; never run on AMD hardware by this project, see docs/rocm.md), else Triton). torch on a GPU decodes without graphs: its calls read step metadata back to the host."})
    moe_backend: str = field(default="auto", metadata={"help": "Kernel of MXFP4 (Quark) routed experts: auto | torch | triton | aiter (auto: the torch reference on CPU; aiter's fused MoE where it runs and takes the layer, else Triton; see docs/rocm.md)."})
    fuse_shared_experts: bool = field(default=True, metadata={"help": "MXFP4 (Quark) DeepSeek-V3 / Kimi checkpoints: a shared expert the quantization config gives the routed experts' format runs as one more routed expert (SGLang's shared-experts fusion: one fused-MoE launch pair for both, the same tokens in fp32); not with --moe-backend aiter. --no-fuse-shared-experts keeps it a separate MLP."})
    seed: int = field(default=0, metadata={"help": "Seed for requests that bring none."})
    method: str | None = field(default=None, metadata={"help": "Speculative decoding method: eagle3 (needs --draft-model)."})
    draft_model: str | None = field(default=None, metadata={"help": "EAGLE3 draft checkpoint folder (LlamaForCausalLMEagle3 or Eagle3DeepseekV2ForCausalLM)."})
    num_speculative_tokens: int = field(default=3, metadata={"help": "Draft tokens proposed and verified per step, 1..8: with --speculative-adaptive the most a step proposes."})
    speculative_adaptive: bool = field(default=False, metadata={"help": "Opt-in, with --method eagle3: choose each step's draft count k in 0..--num-speculative-tokens from the batch size, the running per-position acceptance and the decode step's cost measured at start-up (docs/adaptive_speculation.md); --no-speculative-adaptive: k = --num-speculative-tokens every step."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be an integer >= 1; got {self.tensor_parallel_size!r}")
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"--dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"--device must be auto, cuda or cpu; got {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.mxfp4_activations not in ACTIVATION_MODES:
            raise ValueError(f"--mxfp4-activations must be one of {', '.join(ACTIVATION_MODES)}; "
                             f"got {self.mxfp4_activations!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two; got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be >= 1; got {self.num_kv_blocks}")
        check_backend_choice(self.attention_backend, "--attention-backend")
        check_backend_choice(self.moe_backend, "--moe-backend")
        for flag, value in (("--attention-backend", self.attention_backend), ("--moe-backend", self.moe_backend)):
            if value == "aiter":  # refuse here, before any weight is read, where aiter cannot run
                check_aiter_available(flag, detect_platform(resolve_device(self.device)))
                if self.dtype in ("float16", "float32"):
                    raise ValueError(f"{flag} aiter runs bf16 models (its MLA and MXFP4 MoE kernels take bf16 "
                                     f"activations); got --dtype {self.dtype}: use --dtype bfloat16 or auto")
        if self.method not in (None, "eagle3"):
            raise ValueError(f"--method {self.method!r} is not supported; the only method is eagle3")
        if self.method is None and self.draft_model is not None:
            raise ValueError("--draft-model was given without --method eagle3")
        if self.method == "eagle3":
            if self.draft_model is None:
                raise ValueError("--method eagle3 needs --draft-model DIR (an EAGLE3 draft checkpoint)")
            if not 1 <= self.num_speculative_tokens <= MAX_DRAFTS:
                raise ValueError(f"--num-speculative-tokens must be in 1..{MAX_DRAFTS}; got {self.num_speculative_tokens}")
            if self.max_num_batched_tokens < self.num_speculative_tokens + 1:
                raise ValueError(
                    f"--max-num-batched-tokens {self.max_num_batched_tokens} cannot hold one verify step "
                    f"({self.num_speculative_tokens} draft tokens + 1)"
                )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add every field as a flag; each accepts `--kebab-case` and `--snake_case` spellings."""
        for f in dataclasses.fields(EngineArgs):
            add_flag(parser, f.name, f.type, f.default, f.metadata["help"], f.metadata.get("short"))
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def add_flag(parser: argparse.ArgumentParser, name: str, type_: type | str, default: Any, help: str,
             short: str | None = None) -> None:
    """One flag with both spellings (ATOM accepts both, users paste both). `type_` is a type or
    a dataclass field's string annotation such as "int | None". A bool that defaults to off is
    a switch (`--x`); one that defaults to on also gets its off form (`--no-x`)."""
    spellings = [f"--{name.replace('_', '-')}"]
    if "_" in name:
        spellings.append(f"--{name}")
    if short:
        spellings.insert(0, short)
    kind = type_ if isinstance(type_, type) else _ANNOTATION_TYPES[str(type_).removesuffix(" | None")]
    if default is not None and kind is not bool:  # --help shows what leaving a flag out means
        help = f"{help} (default: %(default)s)"
    if kind is bool:
        action = argparse.BooleanOptionalAction if default else "store_true"
        parser.add_argument(*spellings, dest=name, action=action, default=default, help=help)
    else:
        parser.add_argument(*spellings, dest=name, type=kind, default=default, help=help)


_ANNOTATION_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


# ----------------------------------------------------------------------------- model config

def read_config_json(path: str) -> dict[str, Any]:
    """The checkpoint's config.json as written, or a ValueError naming the file and the fault."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} is not a checkpoint folder: it has no config.json")
    try:
        with open(file, encoding="utf-8") as f:
            stated = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}): fix it or download it again") from e
    if not isinstance(stated, dict):
        raise ValueError(f"{file} holds a JSON {type(stated).__name__}, not an object of config fields")
    return stated


def load_model_config(path: str, trust_remote_code: bool = False) -> PretrainedConfig:
    check_rope_scaling(read_config_json(path), f"{path}/config.json")
    register_config_aliases()
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except StrictDataclassError as e:  # transformers' typed fields, e.g. kv_lora_rank "512": say which file
        raise ValueError(f"{path}/config.json: {e}") from e


_POSITIVE_ROPE_FIELDS = ("factor", "original_max_position_embeddings")


def check_rope_scaling(stated: dict[str, Any], file: str) -> None:
    """RoPE scaling numbers must be positive (transformers loads a negative factor silently)."""
    sections = {"": stated, "text_config.": stated.get("text_config")}
    for prefix, section in sections.items():
        if not isinstance(section, dict):
            continue
        for key in ("rope_scaling", "rope_parameters"):
            params = section.get(key)
            # transformers 5 may nest one dict per attention type under rope_parameters
            nested = [params] + [v for v in params.values() if isinstance(v, dict)] if isinstance(params, dict) else []
            for entry in nested:
                for name in _POSITIVE_ROPE_FIELDS:
                    value = entry.get(name)
                    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                  and math.isfinite(value) and value > 0):
                        raise ValueError(f"{file}: {prefix}{key}.{name} is {value!r}; it must be a positive number "
                                         "(the checkpoint's context scaling): fix it, or download the config again")


def require_stated_fields(config: PretrainedConfig, path: str, fields: tuple[str, ...], needed_by: str) -> None:
    """Raise, naming the field, if the checkpoint's config.json leaves out one of `fields` (a
    dotted name reaches into a section, e.g. Kimi's "text_config.hidden_size"): its config class
    would fill the gap with a default that describes some other model."""
    stated = read_config_json(path)
    for name in fields:
        section: Any = stated
        for part in name.split("."):
            section = section.get(part, _MISSING) if isinstance(section, dict) else _MISSING
        if section is _MISSING:
            default: Any = config
            for part in name.split("."):
                default = getattr(default, part, None)
            shown = repr(default) if isinstance(default, (int, float, str, type(None))) else f"{type(default).__name__}'s defaults"
            raise ValueError(f"{path}/config.json has no {name}, which {needed_by} needs: add it (with it missing, "
                             f"{type(config).__name__} would fill in {shown}, another model's value)")


_MISSING = object()


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """transformers' AutoTokenizer, failing with the folder named: a tokenizer file cut short fails
    deep inside transformers or tokenizers (sometimes with an untyped Exception) without it."""
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # whatever the third-party loaders raise, the user needs the folder
        reason = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"the tokenizer in {path} could not be loaded ({type(e).__name__}: {reason}): "
                         "fix or download its tokenizer files again, or pass --tokenizer DIR") from e


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language-model config of a multimodal wrapper (Kimi-K2.5's text_config), else the config."""
    return config.get_text_config()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA/ROCm GPU")
    return torch.device(name)


def resolve_dtype(name: str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (so the exact-match guarantees hold there); on GPU the checkpoint's
    half type, bfloat16 when the checkpoint is float32."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    stored = getattr(text_config(config), "dtype", None) or getattr(config, "torch_dtype", None)
    return torch.float16 if stored in (torch.float16, "float16") else torch.bfloat16


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """auto: the model dtype; fp8 / fp8_e4m3: the platform's e4m3 variant."""
    return dtype if name == "auto" else fp8_kv_dtype(device)


def resolve_max_model_len(requested: int | None, config: PretrainedConfig) -> int:
    limit = getattr(text_config(config), "max_position_embeddings", None)
    if requested is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings: pass --max-model-len")
        return int(limit)
    if requested < 2:
        raise ValueError(f"--max-model-len must be >= 2; got {requested}")
    if limit is not None and requested > limit:
        logger.warning("--max-model-len %d exceeds the model's max_position_embeddings %d", requested, limit)
    return requested
