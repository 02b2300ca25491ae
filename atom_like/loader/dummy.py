"""`--load-format dummy` (vLLM's name): build the model from config.json alone and fill every
weight with seeded random values instead of reading a checkpoint.

What for: benchmarks at a released model's real size and shapes without its files
(ci/bench_kimi.py runs one TP8 rank of Kimi-K2.5-MXFP4 this way); the tokens such a model
generates mean nothing. The model is built exactly as for a checkpoint (quantization config,
tensor-parallel slice, draft), so the kernels, shapes and bytes are the real ones.

Values, chosen so activations keep a sane magnitude through every layer (no inf/NaN in bf16):
  * float weights ~ N(0, 0.02) (the usual initializer_range); RMSNorm weights 1; biases 0 (the
    router's e_score_correction_bias too: selection by the scores alone);
  * packed MXFP4 storage (uint8, model_ops.quant.mxfp4_layers): random bytes for the E2M1 codes
    (two a byte, rms 2.9 over the 16 codes) and E8M0 scale bytes 119..121 (2^-8..2^-6), so a
    dequantized weight has rms ~0.01-0.05;
  * integer parameters (an EAGLE3 draft's d2t) 0: the identity vocabulary mapping.
fp8 KV-cache scales are 1.0 (the engine's default where a checkpoint carries none).
Everything is filled in place on the parameters' device from one generator seeded with --seed,
in parameter order: on a GPU, 75 GB take about a second.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from atom_like.loader.weights import process_after_loading
from model_ops.layernorm import RMSNorm

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")
STD = 0.02
E8M0_BYTES = (119, 122)  # [low, high): scales 2^-8 .. 2^-6


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of `model` (see the module docstring), then let modules rearrange
    them for their kernels as after a real load."""
    start, filled = time.perf_counter(), 0
    generator: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            data = param.data
            if data.device not in generator:
                generator[data.device] = torch.Generator(device=data.device).manual_seed(seed)
            g = generator[data.device]
            filled += data.numel() * data.element_size()
            if data.dtype == torch.uint8:  # packed MXFP4: E8M0 scales or E2M1 code pairs
                low, high = E8M0_BYTES if name.endswith("scale") else (0, 256)
                data.random_(low, high, generator=g)
            elif not data.is_floating_point():
                data.zero_()
            elif isinstance(module, RMSNorm):
                data.fill_(1.0)
            elif name == "bias" or name.endswith("_bias"):
                data.zero_()
            elif data.element_size() == 1:  # fp8 weights: no in-place normal_ on them
                data.copy_(torch.empty(data.shape, device=data.device).normal_(0.0, STD, generator=g))
            else:
                data.normal_(0.0, STD, generator=g)
    process_after_loading(model)
    for device in generator:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    logger.info("--load-format dummy: %s filled with seeded random weights, %.2f GiB in %.2f s",
                type(model).__name__, filled / 2**30, time.perf_counter() - start)
