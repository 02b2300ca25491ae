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
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, PretrainedConfig

from atom_like.models.config_aliases import register_config_aliases
from model_ops.attention.backends import BACKEND_CHOICES

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class EngineArgs:
    model: str | None = field(default=None, metadata={"help": "Checkpoint folder (HF layout: config.json + *.safetensors)."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer folder (default: --model)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom code in the checkpoint's config."})
    dtype: str = field(default="auto", metadata={"help": "auto | bfloat16 | float16 | float32 (auto: float32 on CPU, the checkpoint's half type on GPU)."})
    device: str = field(default="auto", metadata={"help": "auto | cuda | cpu (ROCm GPUs are 'cuda' in torch)."})
    tensor_parallel_size: int = field(default=1, metadata={"help": "Tensor-parallel ranks: one process and one GPU each (gloo processes on CPU); see docs/parallel.md.", "short": "-tp"})
    block_size: int = field(default=16, metadata={"help": "Tokens per KV-cache block."})
    max_num_seqs: int = field(default=256, metadata={"help": "Most sequences in one step."})
    max_num_batched_tokens: int = field(default=8192, metadata={"help": "Most query tokens in one step (longer prompts are prefilled in chunks)."})
    max_model_len: int | None = field(default=None, metadata={"help": "Longest prompt + output (default: the model's max_position_embeddings)."})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "Fraction of GPU memory the engine may use (weights, activations, KV cache)."})
    num_kv_blocks: int | None = field(default=None, metadata={"help": "KV-cache blocks, overriding the automatic size."})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "KV-cache dtype: auto (= model dtype)."})
    enforce_eager: bool = field(default=False, metadata={"help": "Never use CUDA/HIP graphs."})
    attention_backend: str = field(default="auto", metadata={"help": "auto | torch | triton | aiter (auto: the torch reference on CPU, the fastest kernel on a GPU)."})
    seed: int = field(default=0, metadata={"help": "Seed for requests that bring none."})
    method: str | None = field(default=None, metadata={"help": "Speculative decoding method: eagle3 (needs --draft-model)."})
    draft_model: str | None = field(default=None, metadata={"help": "EAGLE3 draft checkpoint folder (LlamaForCausalLMEagle3 or Eagle3DeepseekV2ForCausalLM)."})
    num_speculative_tokens: int = field(default=3, metadata={"help": "Draft tokens proposed and verified per step (k >= 1)."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be an integer >= 1; got {self.tensor_parallel_size!r}")
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"--dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"--device must be auto, cuda or cpu; got {self.device!r}")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not supported yet (only auto).")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two; got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be >= 1; got {self.num_kv_blocks}")
        if self.attention_backend not in BACKEND_CHOICES:
            raise ValueError(f"--attention-backend must be one of {', '.join(BACKEND_CHOICES)}; got {self.attention_backend!r}")
        if self.method not in (None, "eagle3"):
            raise ValueError(f"--method {self.method!r} is not supported; the only method is eagle3")
        if self.method is None and self.draft_model is not None:
            raise ValueError("--draft-model was given without --method eagle3")
        if self.method == "eagle3":
            if self.draft_model is None:
                raise ValueError("--method eagle3 needs --draft-model DIR (an EAGLE3 draft checkpoint)")
            if self.num_speculative_tokens < 1:
                raise ValueError(f"--num-speculative-tokens must be >= 1; got {self.num_speculative_tokens}")
            if self.max_num_batched_tokens < self.num_speculative_tokens + 1:
                raise ValueError(
                    f"--max-num-batched-tokens {self.max_num_batched_tokens} cannot hold one verify step "
                    f"({self.num_speculative_tokens} draft tokens + 1)"
                )

    @property
    def spec_tokens(self) -> int:
        """Draft tokens per step, 0 without speculation."""
        return self.num_speculative_tokens if self.method else 0

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
    a dataclass field's string annotation such as "int | None"."""
    spellings = [f"--{name.replace('_', '-')}"]
    if "_" in name:
        spellings.append(f"--{name}")
    if short:
        spellings.insert(0, short)
    kind = type_ if isinstance(type_, type) else _ANNOTATION_TYPES[str(type_).removesuffix(" | None")]
    if kind is bool:
        parser.add_argument(*spellings, dest=name, action="store_true", default=default, help=help)
    else:
        parser.add_argument(*spellings, dest=name, type=kind, default=default, help=help)


_ANNOTATION_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


# ----------------------------------------------------------------------------- model config

def load_model_config(path: str, trust_remote_code: bool = False) -> PretrainedConfig:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} is not a checkpoint folder: it has no config.json")
    register_config_aliases()
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except StrictDataclassError as e:  # transformers' typed fields, e.g. kv_lora_rank "512": say which file
        raise ValueError(f"{path}/config.json: {e}") from e


def require_stated_fields(config: PretrainedConfig, path: str, fields: tuple[str, ...], needed_by: str) -> None:
    """Raise, naming the field, if the checkpoint's config.json leaves out one of `fields`: its
    config class would fill the gap with a default that describes some other model."""
    with open(os.path.join(path, "config.json")) as f:
        stated = json.load(f)
    for name in fields:
        if name not in stated:
            raise ValueError(f"{path}/config.json has no {name}, which {needed_by} needs; {type(config).__name__} "
                             f"would default it to {getattr(config, name, None)!r}, another model's value")


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
