"""Compile every kernel for NVIDIA sm_90 (H100/H200) and AMD gfx942 (MI300) / gfx950 (MI355) with no GPU.

The real wrappers run on "meta" tensors at model sizes (Kimi MLA and EAGLE3 draft, SmolLM2, the
MoE shapes of the benchmark); each kernel launch is compiled for the target instead of launched,
with exactly the configuration (constexprs, num_warps, num_stages, ROCm tile choices) the wrapper
picks there. Reports registers, spills and shared memory (LDS) and fails on a compile error, any
register spill or scratch use, or shared memory above the target's per-block limit.

AMD targets need only triton (its LLVM and linker are bundled). NVIDIA needs ptxas
(TRITON_PTXAS_PATH, ptxas on PATH, or the one in triton's wheel); without it sm_90 is skipped.
`--sass` also prints, per sm_90 variant, the instructions of the kernel's main loop (the longest
backward branch in nvdisasm's listing) by opcode: what a loop costs a warp per iteration; and the
instructions before and after that loop (a program's setup and epilogue).
Usage: python ci/compile_kernels.py [--targets sm90,gfx942,gfx950] [--quick] [--cases SUBSTRING] [--sass]
Must run without TRITON_INTERPRET (interpreted kernels cannot be compiled).
Uses Triton 3.6 internals (the JIT binder) to derive signatures the way a launch would.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "ci"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_kernels: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
if "TRITON_PTXAS_PATH" not in os.environ and shutil.which("ptxas"):
    os.environ["TRITON_PTXAS_PATH"] = shutil.which("ptxas")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

if "TRITON_PTXAS_PATH" not in os.environ:
    with contextlib.suppress(RuntimeError):  # triton's wheel bundles ptxas (and nvdisasm)
        os.environ["TRITON_PTXAS_PATH"] = triton.knobs.nvidia.ptxas.path

import kernels_rocm.allreduce_rms_norm as ar_norm_mod  # noqa: E402
import kernels_rocm.fused_moe as fused_moe_mod  # noqa: E402
import kernels_rocm.mla_decode as mla_mod  # noqa: E402
import kernels_rocm.moe_routing as routing_mod  # noqa: E402
import kernels_rocm.mxfp4_linear as mxfp4_linear_mod  # noqa: E402
import kernels_rocm.mxfp4_moe as mxfp4_moe_mod  # noqa: E402
import kernels_rocm.mxfp4_moe_decode as mxfp4_moe_decode_mod  # noqa: E402
import kernels_rocm.mxfp4_moe_expert_gemv as expert_gemv_mod  # noqa: E402
import kernels_rocm.paged_attention as paged_mod  # noqa: E402
import kernels_rocm.skinny_gemm as skinny_mod  # noqa: E402
from kernels_rocm.kv_cache import write_kv_cache, write_mla_kv_cache  # noqa: E402
from kernels_rocm.activation import silu_and_mul  # noqa: E402
from kernels_rocm.greedy_verify import greedy_verify  # noqa: E402
from kernels_rocm.sampled_verify import sampled_verify  # noqa: E402
from kernels_rocm.step_advance import advance, draft_starts  # noqa: E402
from kernels_rocm.rms_norm import fused_add_rms_norm, rms_norm  # noqa: E402
from kernels_rocm.rope_kv_cache import rope_write_kv_cache, rope_write_mla_kv_cache  # noqa: E402


@dataclass(frozen=True)
class Target:
    gpu: GPUTarget
    shared_limit: int  # bytes of shared memory / LDS one program may use

    @property
    def is_hip(self) -> bool:
        return self.gpu.backend == "hip"


TARGETS = {
    "sm90": Target(GPUTarget("cuda", 90, 32), 232_448),  # H100/H200: 227 KiB per block
    "gfx942": Target(GPUTarget("hip", "gfx942", 64), 65_536),  # MI300X: 64 KiB LDS
    "gfx950": Target(GPUTarget("hip", "gfx950", 64), 163_840),  # MI355X: 160 KiB LDS
}


def _t(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _attention_metadata(num_seqs: int, max_query_len: int, max_context_len: int, block_size: int = 16):
    return (
        _t(num_seqs + 1, dtype=torch.int32), _t(num_seqs, dtype=torch.int32),
        _t(num_seqs, -(-max_context_len // block_size), dtype=torch.int32), max_query_len, max_context_len,
    )



def _fp8_dtype(target: str) -> torch.dtype:
    """The KV type the platform uses: e4m3fnuz on gfx942 (MI300), OCP e4m3fn elsewhere."""
    return torch.float8_e4m3fnuz if target == "gfx942" else torch.float8_e4m3fn


def _mha(heads, kv_heads, dim, seqs, q_len, ctx, splits, kv_dtype=None):
    tokens = seqs * q_len
    pool = _t(2, seqs * ctx // 16 + 1, 16, kv_heads, dim, dtype=kv_dtype or torch.bfloat16)
    scales = dict(k_scale=_t(1, dtype=torch.float32), v_scale=_t(1, dtype=torch.float32)) if kv_dtype else {}
    paged_mod.paged_attention(_t(tokens, heads, dim), pool[0], pool[1], *_attention_metadata(seqs, q_len, ctx),
                              dim**-0.5, num_kv_splits=splits, **scales)


def _mla(heads, seqs, q_len, ctx, splits, block_size=16, kv_dtype=None):
    tokens = seqs * q_len
    q = _t(tokens, heads, 576)
    cache = _t(seqs * ctx // block_size + 1, block_size, 576, dtype=kv_dtype or torch.bfloat16)
    scale = _t(1, dtype=torch.float32) if kv_dtype else None
    mla_mod.mla_paged_attention(q[..., :512], q[..., 512:], cache, *_attention_metadata(seqs, q_len, ctx, block_size),
                                0.072, kv_scale=scale, num_kv_splits=splits)


def _rope_mha(kv_dtype=None):
    """Llama-3.1-8B: 32 q / 8 kv heads, D 128 (neox)."""
    scales = dict(k_scale=_t(1, dtype=torch.float32), v_scale=_t(1, dtype=torch.float32)) if kv_dtype else {}
    rope_write_kv_cache(_t(64, 32, 128), _t(64, 8, 128), _t(64, 8, 128), _t(99, 16, 8, 128, dtype=kv_dtype or torch.bfloat16),
                        _t(99, 16, 8, 128, dtype=kv_dtype or torch.bfloat16), _t(64, 64), _t(64, 64),
                        _t(64, dtype=torch.int64), **scales)


def _rope_mla(kv_dtype=None, heads=64, norm=False):
    """Kimi: `heads` heads' q_pe (64; 8 a TP8 rank), latent rows 512 + 64 (interleaved); `norm`:
    with kv_a_layernorm fused."""
    scale = _t(1, dtype=torch.float32) if kv_dtype else None
    norm_args = dict(norm_weight=_t(512), norm_eps=1e-6) if norm else {}
    rope_write_mla_kv_cache(_t(64, heads, 64), _t(64, 512), _t(64, 64), _t(99, 16, 576, dtype=kv_dtype or torch.bfloat16),
                            _t(64, 32), _t(64, 32), _t(64, dtype=torch.int64), interleaved=True, scale=scale, **norm_args)


def _mxfp4_linear(m, n, k, quantize, split=None, fold=False):
    config = None
    if split is not None:  # the default tiles with a forced split (meta tensors see 4 compute units)
        config = dataclasses.replace(mxfp4_linear_mod.default_config(m, n, k, torch.device("meta")), split_k=split)
    mxfp4_linear_mod.mxfp4_linear(_t(m, k), _t(n, k // 2, dtype=torch.uint8), _t(n, k // 32, dtype=torch.uint8),
                                  quantize_activations=quantize, config=config, fold_scales=fold)


def _mxfp4_moe(experts, top_k, hidden, inter, tokens, quantize, split=None, decode=False, expert_gemv=False,
               down_n_tiles=None, down_block_k=None, fold=False):
    """decode: True for DecodeConfig(), or a DecodeConfig; down_n_tiles / down_block_k: the grouped
    path's default tiles with GEMM 2 programs walking that many N tiles / with that K tile."""
    config = (decode if isinstance(decode, mxfp4_moe_decode_mod.DecodeConfig)
              else mxfp4_moe_decode_mod.DecodeConfig() if decode else None)
    if expert_gemv:  # the launch shape default_config picks at this token count
        config = expert_gemv_mod.default_config(tokens * top_k, experts, inter)
    if split is not None:  # the default tiles with a forced GEMM 1 split
        config = mxfp4_moe_mod.default_config(tokens, top_k, experts, hidden, inter, torch.device("meta"))
        config = dataclasses.replace(config, gate_up=dataclasses.replace(config.gate_up, split_k=split))
    if down_n_tiles is not None:
        config = mxfp4_moe_mod.default_config(tokens, top_k, experts, hidden, inter, torch.device("meta"))
        down = dataclasses.replace(config.down, block_k=down_block_k or config.down.block_k)
        config = dataclasses.replace(config, down=down, down_n_tiles=down_n_tiles)
    u8 = torch.uint8
    mxfp4_moe_mod.fused_moe_mxfp4(
        _t(tokens, hidden), _t(experts, 2 * inter, hidden // 2, dtype=u8), _t(experts, 2 * inter, hidden // 32, dtype=u8),
        _t(experts, hidden, inter // 2, dtype=u8), _t(experts, hidden, inter // 32, dtype=u8),
        _t(tokens, top_k, dtype=torch.float32), _t(tokens, top_k, dtype=torch.int32), quantize, config=config,
        fold_scales=fold)


def _skinny_sweep(target: str):
    """Every config ci/bench_roofline.py times on the H100. NVIDIA only: on gfx942/gfx950 six of
    the widest (block_n 32 at M 2; 8 warps with block_n x M >= 32) spill VGPRs; the defaults do not."""
    if target != "sm90":
        return
    from bench_roofline import gemv_sweep

    for m in (1, 2, 4, 8):
        for config in gemv_sweep(m):
            skinny_mod.skinny_gemm(_t(m, 4096), _t(6144, 4096), config)


def _moe(experts, top_k, hidden, inter, tokens):
    fused_moe_mod.fused_moe(_t(tokens, hidden), _t(experts, 2 * inter, hidden), _t(experts, hidden, inter),
                            _t(tokens, top_k, dtype=torch.float32), _t(tokens, top_k, dtype=torch.int32))


# case name -> builder(target name); most builders ignore the target
CASES: dict[str, Callable[[str], None]] = {
    "kv write MHA 8x128": lambda _: write_kv_cache(_t(64, 8, 128), _t(64, 8, 128), _t(99, 16, 8, 128),
                                                 _t(99, 16, 8, 128), _t(64, dtype=torch.int64)),
    "kv write MLA 512+64": lambda _: write_mla_kv_cache(_t(64, 512), _t(64, 64), _t(99, 16, 576), _t(64, dtype=torch.int64)),
    "MHA 8/8 D128 decode split 16": lambda _: _mha(8, 8, 128, 4, 1, 32768, 16),
    "MHA 8/8 D128 decode no split": lambda _: _mha(8, 8, 128, 64, 1, 8192, 1),
    "MHA 8/8 D128 verify 4": lambda _: _mha(8, 8, 128, 8, 4, 8192, 4),
    "MHA 32/8 D128 (8B) verify 6, one M tile": lambda _: _mha(32, 8, 128, 8, 6, 8192, 4),
    "MHA 8/8 D128 prefill": lambda _: _mha(8, 8, 128, 2, 2048, 4096, None),
    "MHA 9/3 D64 (SmolLM2) decode split 8": lambda _: _mha(9, 3, 64, 8, 1, 8192, 8),
    "MHA 9/3 D64 prefill": lambda _: _mha(9, 3, 64, 2, 1024, 2048, None),
    "MHA 64/64 D128 decode": lambda _: _mha(64, 64, 128, 8, 1, 8192, 1),
    "MLA 8h decode split 16": lambda _: _mla(8, 4, 1, 32768, 16),
    "MLA 8h verify 4 no split": lambda _: _mla(8, 64, 4, 8192, 1),
    "MLA 16h decode block 64": lambda _: _mla(16, 8, 1, 8192, 4, block_size=64),
    "MLA 64h decode split 128": lambda _: _mla(64, 1, 1, 32768, 128),
    "MoE E64 H2048 I1024 T8": lambda _: _moe(64, 8, 2048, 1024, 8),
    "MoE E64 H2048 I1024 T512": lambda _: _moe(64, 8, 2048, 1024, 512),
    "MoE E384 H7168 I256 T128": lambda _: _moe(384, 8, 7168, 256, 128),
    "MoE alignment 65,536 pairs (three kernels)": lambda _: fused_moe_mod.moe_align_block_size(
        _t(8192, 8, dtype=torch.int32), 384, 64),
    "MXFP4 MoE Kimi TP8 T1 w4a4 split 8": lambda _: _mxfp4_moe(384, 8, 7168, 256, 1, True, split=8),
    "MXFP4 MoE Kimi TP8 T32 w4a4": lambda _: _mxfp4_moe(384, 8, 7168, 256, 32, True),
    "MXFP4 MoE Kimi TP8 T512 w4a16": lambda _: _mxfp4_moe(384, 8, 7168, 256, 512, False),
    "MXFP4 MoE Kimi TP8 T256 w4a4": lambda _: _mxfp4_moe(384, 8, 7168, 256, 256, True),  # grouped, x QDQ'd once
    "MXFP4 MoE Kimi TP8 T256 w4a4 folded scales": lambda _: _mxfp4_moe(384, 8, 7168, 256, 256, True, fold=True),
    # GEMM 2 programs walking 8 N tiles (MoeConfig.down_n_tiles), K tiles of 128 (2 a tile) and 256 (1)
    "MXFP4 MoE Kimi TP8 T512 w4a4 down 8 N tiles": lambda _: _mxfp4_moe(384, 8, 7168, 256, 512, True, down_n_tiles=8),
    # NVIDIA only (a sweep variant of ci/bench_mxfp4.py): 10 bytes spilled on gfx942
    "MXFP4 MoE Kimi TP8 T512 w4a4 down 8 N tiles K256": lambda target: target == "sm90" and _mxfp4_moe(
        384, 8, 7168, 256, 512, True, down_n_tiles=8, down_block_k=256),
    "MXFP4 MoE Kimi E384 I2048 T16 w4a4": lambda _: _mxfp4_moe(384, 8, 7168, 2048, 16, True),
    # prefill_config's tiles (NVIDIA only: AMD keeps the small-M tiles): 64-row blocks, then 128-row
    "MXFP4 MoE Kimi TP8 T2048 w4a4 prefill": lambda target: target == "sm90" and _mxfp4_moe(
        384, 8, 7168, 256, 2048, True),
    "MXFP4 MoE Kimi TP8 T8192 w4a4 prefill": lambda target: target == "sm90" and _mxfp4_moe(
        384, 8, 7168, 256, 8192, True),
    "MXFP4 MoE Kimi TP8 T8192 w4a4 prefill folded scales": lambda target: target == "sm90" and _mxfp4_moe(
        384, 8, 7168, 256, 8192, True, fold=True),
    "MXFP4 MoE decode Kimi TP8 T1 w4a16": lambda _: _mxfp4_moe(384, 8, 7168, 256, 1, False, decode=True),
    "MXFP4 MoE decode Kimi TP8 T1 w4a4": lambda _: _mxfp4_moe(384, 8, 7168, 256, 1, True, decode=True),
    "MXFP4 MoE decode Kimi TP8 T4 w4a16": lambda _: _mxfp4_moe(384, 8, 7168, 256, 4, False, decode=True),
    "MXFP4 MoE decode Kimi TP8 T4 w4a4": lambda _: _mxfp4_moe(384, 8, 7168, 256, 4, True, decode=True),
    "MXFP4 MoE decode Kimi E384 I2048 T1 w4a4": lambda _: _mxfp4_moe(384, 8, 7168, 2048, 1, True, decode=True),
    # the W4A4 launch shapes mxfp4_moe_decode.default_config picks on NVIDIA
    "MXFP4 MoE decode Kimi TP8 T1 w4a4 loads ahead": lambda _: _mxfp4_moe(
        384, 8, 7168, 256, 1, True, decode=mxfp4_moe_decode_mod.DecodeConfig(down_ahead=4)),
    "MXFP4 MoE decode Kimi TP8 T2 w4a4 2-warp tiles": lambda _: _mxfp4_moe(
        384, 8, 7168, 256, 2, True,
        decode=mxfp4_moe_decode_mod.DecodeConfig(gate_up_rows=4, gate_up_warps=2, down_ahead=4)),
    "MXFP4 MoE decode Kimi TP8 T16 w4a4 16-row tiles": lambda _: _mxfp4_moe(
        384, 8, 7168, 256, 16, True,
        decode=mxfp4_moe_decode_mod.DecodeConfig(gate_up_rows=4, gate_up_k_lanes=32, down_rows=4)),
    "MXFP4 MoE decode Kimi E384 I2048 T1 w4a4 16-row tiles": lambda _: _mxfp4_moe(
        384, 8, 7168, 2048, 1, True,
        decode=mxfp4_moe_decode_mod.DecodeConfig(gate_up_rows=4, gate_up_k_lanes=32, down_rows=4)),
    # NVIDIA only: ROCm keeps the grouped GEMMs at these T (the portable integer dots spill VGPRs there)
    **{f"MXFP4 MoE expert GEMV Kimi TP8 (shared fused) T{t} w4a4": (
        lambda target, t=t: target == "sm90" and _mxfp4_moe(385, 9, 7168, 256, t, True, expert_gemv=True))
       for t in (32, 128, 256, 512)},
    "MXFP4 MoE expert GEMV Kimi E384 I2048 T128 w4a4": lambda target: target == "sm90" and _mxfp4_moe(
        384, 8, 7168, 2048, 128, True, expert_gemv=True),
    "MXFP4 linear M4 N512 K7168 w4a4 split 8": lambda _: _mxfp4_linear(4, 512, 7168, True, split=8),
    "MXFP4 linear M64 N7168 K256 w4a16": lambda _: _mxfp4_linear(64, 7168, 256, False),
    # WIDE_TILES (NVIDIA only): 128 x 256 on 8 warps at Kimi TP8's dense gate_up in prefill
    "MXFP4 linear M8192 N4608 K7168 w4a4": lambda target: target == "sm90" and _mxfp4_linear(8192, 4608, 7168, True),
    "MXFP4 linear M8192 N4608 K7168 w4a4 folded scales": lambda target: target == "sm90" and _mxfp4_linear(
        8192, 4608, 7168, True, fold=True),
    "MXFP4 linear M64 N7168 K256 w4a16 folded scales": lambda _: _mxfp4_linear(64, 7168, 256, False, fold=True),
    "kv write MHA fp8": lambda t: write_kv_cache(_t(64, 8, 128), _t(64, 8, 128), _t(99, 16, 8, 128, dtype=_fp8_dtype(t)),
                                                 _t(99, 16, 8, 128, dtype=_fp8_dtype(t)), _t(64, dtype=torch.int64),
                                                 k_scale=_t(1, dtype=torch.float32), v_scale=_t(1, dtype=torch.float32)),
    "kv write MLA fp8": lambda t: write_mla_kv_cache(_t(64, 512), _t(64, 64), _t(99, 16, 576, dtype=_fp8_dtype(t)),
                                                     _t(64, dtype=torch.int64), scale=_t(1, dtype=torch.float32)),
    "MHA 8/8 D128 fp8 decode split 16": lambda t: _mha(8, 8, 128, 4, 1, 32768, 16, kv_dtype=_fp8_dtype(t)),
    "MHA 32/8 D128 fp8 verify 6, one M tile": lambda t: _mha(32, 8, 128, 8, 6, 8192, 4, kv_dtype=_fp8_dtype(t)),
    "MLA 8h fp8 decode split 16": lambda t: _mla(8, 4, 1, 32768, 16, kv_dtype=_fp8_dtype(t)),
    "MLA 8h fp8 verify 4 no split": lambda t: _mla(8, 64, 4, 8192, 1, kv_dtype=_fp8_dtype(t)),
    "rope + kv write MHA 32/8 D128": lambda _: _rope_mha(),
    "rope + kv write MHA fp8": lambda t: _rope_mha(_fp8_dtype(t)),
    "rope + kv write MLA 64h 512+64": lambda _: _rope_mla(),
    "rope + kv write MLA fp8": lambda t: _rope_mla(_fp8_dtype(t)),
    "rope + kv write MLA 8h + latent norm": lambda _: _rope_mla(heads=8, norm=True),
    "rope + kv write MLA 64h + latent norm": lambda _: _rope_mla(norm=True),
    "rope + kv write MLA 8h fp8 + latent norm": lambda t: _rope_mla(_fp8_dtype(t), heads=8, norm=True),
    "SiLU-and-mul I14336": lambda _: silu_and_mul(_t(64, 2 * 14336)),
    "skinny GEMM M1 N6144 K4096": lambda _: skinny_mod.skinny_gemm(_t(1, 4096), _t(6144, 4096)),
    "skinny GEMM M8 N4096 K14336": lambda _: skinny_mod.skinny_gemm(_t(8, 14336), _t(4096, 14336)),
    "skinny GEMM + SwiGLU M1 N28672 K4096": lambda _: skinny_mod.skinny_gemm(_t(1, 4096), _t(28672, 4096), swiglu=True),
    "skinny GEMM fp32 M3": lambda _: skinny_mod.skinny_gemm(_t(3, 4096, dtype=torch.float32),
                                                            _t(4096, 4096, dtype=torch.float32)),
    "skinny GEMM, bench_roofline's sweep at M 1, 2, 4, 8": _skinny_sweep,
    # Kimi TP8 q_b_proj with q_a_layernorm as its prologue, in the config an H200 (132 SMs) picks
    "skinny GEMM + RMSNorm prologue M1 N1536 K1536": lambda _: skinny_mod.skinny_gemm(
        _t(1, 1536), _t(1536, 1536), skinny_mod.default_config(1, 1536, 132), norm_weight=_t(1536)),
    "skinny GEMM + RMSNorm prologue M4 N1536 K1536": lambda _: skinny_mod.skinny_gemm(
        _t(4, 1536), _t(1536, 1536), skinny_mod.default_config(4, 1536, 132), norm_weight=_t(1536)),
    "skinny GEMM fp32 out (router) M4 N384 K7168": lambda _: skinny_mod.skinny_gemm(_t(4, 7168), _t(384, 7168),
                                                                                   out_dtype=torch.float32),
    **{f"skinny bmm MLA absorb Kimi {tp} T{t} {name}": (lambda _, t=t, h=h, n=n, k=k: skinny_mod.skinny_bmm(
        _t(t, h, k), _t(h, n, k)))
       for tp, h in (("TP8", 8), ("TP1", 64)) for t in (1, 4)
       for name, n, k in (("W_UK^T", 512, 128), ("W_UV", 128, 512))},
    "MoE routing Kimi E384 top-8": lambda _: routing_mod.route_topk(_t(4, 384, dtype=torch.float32),
                                                                    _t(384, dtype=torch.float32), 8, sigmoid=True),
    "MoE routing DeepSeek-V3 E256 8 groups": lambda _: routing_mod.route_topk(
        _t(64, 256, dtype=torch.float32), _t(256, dtype=torch.float32), 8, sigmoid=True, n_group=8, topk_group=4),
    "all-reduce + add + RMSNorm 2 ranks H4096": lambda _: ar_norm_mod.allreduce_add_rms_norm(
        _t(4, 4096), _t(4, 4096), _t(4096), 1e-6, (_t(2 * 2 * 64 * 8192, dtype=torch.int16),) * 2,
        _t(64, dtype=torch.int32), _t(1, dtype=torch.int32), rank=1),
    "all-reduce + add + RMSNorm 8 ranks H7168": lambda _: ar_norm_mod.allreduce_add_rms_norm(
        _t(4, 7168), _t(4, 7168), _t(7168), 1e-6, (_t(2 * 8 * 64 * 8192, dtype=torch.int16),) * 8,
        _t(64, dtype=torch.int32), _t(1, dtype=torch.int32), rank=3),
    "step advance k 3": lambda _: advance(_t(3, 64, dtype=torch.int64), _t(64, dtype=torch.int64),
                                          _t(64, 4, dtype=torch.int64), _t(64, 3, dtype=torch.int64),
                                          *(_t(256, dtype=torch.int64) for _ in range(2)), _t(64, dtype=torch.int32),
                                          _t(64, 512, dtype=torch.int32), _t(256, dtype=torch.int64), 16),
    "draft starts B256": lambda _: draft_starts(_t(3, 200, dtype=torch.int64), _t(100, dtype=torch.int64),
                                                _t(100, 6, dtype=torch.int64), _t(256, dtype=torch.int64),
                                                _t(256, dtype=torch.int64), 4),
    "greedy verify k 5 B64": lambda _: greedy_verify(_t(384, dtype=torch.int64), _t(320, dtype=torch.int64),
                                                     _t(64, 6, dtype=torch.int64), _t(64, 5, dtype=torch.int64),
                                                     _t(64, 5, dtype=torch.bool)),
    # a sampled step's rows then its verified tokens (both launches): Kimi's vocabulary at batch 64, k 5,
    # and SmolLM2's at batch 1, k 1, in bf16 and fp32 logits
    "sampled verify k 5 B64 V163840": lambda _: sampled_verify(
        _t(384, 163_840), _t(384, dtype=torch.float32), _t(320, dtype=torch.float32),
        _t(384, 163_840, dtype=torch.float32), _t(320, dtype=torch.int64), _t(64, 6, dtype=torch.int64),
        _t(64, 5, dtype=torch.int64), _t(64, 5, dtype=torch.bool)),
    "sampled verify k 1 B1 V49152 fp32": lambda _: sampled_verify(
        _t(2, 49_152, dtype=torch.float32), _t(2, dtype=torch.float32), _t(1, dtype=torch.float32),
        _t(2, 49_152, dtype=torch.float32), _t(1, dtype=torch.int64), _t(1, 2, dtype=torch.int64),
        _t(1, 1, dtype=torch.int64), _t(1, 1, dtype=torch.bool)),
    "RMSNorm H7168": lambda _: rms_norm(_t(64, 7168), _t(7168), 1e-6),
    "add+RMSNorm H7168": lambda _: fused_add_rms_norm(_t(64, 7168), _t(64, 7168), _t(7168), 1e-6),
}
QUICK_CASES = ("kv write MHA 8x128", "MHA 8/8 D128 decode split 16", "MLA 8h decode split 16",
               "MoE E64 H2048 I1024 T8", "add+RMSNorm H7168", "MXFP4 MoE Kimi TP8 T1 w4a4 split 8",
               "MXFP4 MoE decode Kimi TP8 T1 w4a4",
               "MXFP4 linear M4 N512 K7168 w4a4 split 8", "kv write MLA fp8", "MLA 8h fp8 decode split 16",
               "rope + kv write MHA 32/8 D128", "rope + kv write MLA fp8", "SiLU-and-mul I14336",
               "skinny GEMM M8 N4096 K14336")


@dataclass
class Report:
    case: str
    kernel: str
    target: str
    registers: int
    spilled_bytes: int
    shared: int
    error: str | None = None
    loop_sass: collections.Counter | None = None  # sm_90 main-loop opcodes, with --sass
    outside_loop: tuple[int, int] = (0, 0)  # sm_90 instructions before / after the main loop, with --sass


def _nvidia_usage(ptx: str) -> tuple[int, int]:
    """(registers, spill store bytes) from `ptxas -v` on the kernel's PTX."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([os.environ["TRITON_PTXAS_PATH"], "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return registers, spills


def loop_sass(cubin: bytes) -> tuple[collections.Counter, tuple[int, int]]:
    """Opcodes (predicates dropped) of the longest loop in a cubin: the body between a label and
    the last branch back to it, from triton's nvdisasm; and the instructions before and after it
    (a program's setup and epilogue, side paths included: an upper bound of what one runs)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listing = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", f.name],
                                 capture_output=True, text=True, check=True).stdout.splitlines()
    labels = {m.group(1): i for i, line in enumerate(listing) if (m := re.match(r"^(\.L_x_\d+):", line))}
    is_instruction = [bool(re.search(r"/\*[0-9a-f]{4}\*/", line)) for line in listing]
    body: list[str] = []
    span = (0, -1)
    for i, line in enumerate(listing):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i) < i:
            candidate = [x for x, ok in zip(listing[labels[target.group(1)]:i + 1], is_instruction[labels[target.group(1)]:i + 1]) if ok]
            if len(candidate) > len(body):
                body, span = candidate, (labels[target.group(1)], i)
    # the listing ends with the `BRA` to itself after the last EXIT: not part of any program's path
    end = max(i for i, line in enumerate(listing) if "EXIT" in line) + 1 if body else span[1] + 1
    outside = (sum(is_instruction[:span[0]]), sum(is_instruction[span[1] + 1:end]))
    return collections.Counter(re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", x).group(1) for x in body), outside


def _amd_usage(amdgcn: str) -> tuple[int, int]:
    """(VGPRs, spilled VGPR/SGPR count + scratch bytes) from the AMDGCN assembly metadata."""
    vgprs = int(re.search(r"\.vgpr_count:\s+(\d+)", amdgcn).group(1))
    spills = sum(int(n) for n in re.findall(r"\.[sv]gpr_spill_count:\s+(\d+)", amdgcn))
    scratch = int(re.search(r"; ScratchSize: (\d+)", amdgcn).group(1))
    return vgprs, spills + scratch


class _CompileInsteadOfLaunch:
    """While active, `kernel[grid](...)` compiles for `target` (with the arguments a launch would
    specialize on) and records a Report instead of launching."""

    def __init__(self, target_name: str, case: str, reports: list[Report], seen: set, sass: bool = False):
        self.target_name, self.case, self.reports, self.seen, self.sass = target_name, case, reports, seen, sass

    def run(self, fn: JITFunction, *args, grid, warmup, **kwargs):
        target = TARGETS[self.target_name]
        backend = make_backend(target.gpu)
        kwargs.setdefault("debug", False)
        if not target.is_hip and "PDL" in fn.arg_names:  # what an sm_90 launch runs (kernels_rocm._pdl)
            kwargs.update(PDL=True, launch_pdl=True)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
        key = (fn.__name__, str(signature), str(constexprs), str(attrs), str(options))
        if key in self.seen:
            return None
        self.seen.add(key)
        report = Report(self.case, fn.__name__, self.target_name, 0, 0, 0)
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target.gpu,
                                      options=options.__dict__)
            report.shared = compiled.metadata.shared
            usage = _amd_usage(compiled.asm["amdgcn"]) if target.is_hip else _nvidia_usage(compiled.asm["ptx"])
            report.registers, report.spilled_bytes = usage
            if self.sass and not target.is_hip:
                report.loop_sass, report.outside_loop = loop_sass(compiled.asm["cubin"])
        except Exception as exc:  # report every failure, keep compiling the rest
            report.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
        self.reports.append(report)
        return None

    @contextlib.contextmanager
    def active(self):
        original = JITFunction.run
        hip = TARGETS[self.target_name].is_hip
        modules = (paged_mod, mla_mod, fused_moe_mod, mxfp4_linear_mod, mxfp4_moe_mod, mxfp4_moe_decode_mod,
                   expert_gemv_mod, skinny_mod)
        saved = [m.IS_HIP for m in modules]
        JITFunction.run = lambda fn, *a, **k: self.run(fn, *a, **k)
        for m in modules:
            m.IS_HIP = hip  # the wrappers' ROCm tile choices follow the target, not this machine
        try:
            yield
        finally:
            JITFunction.run = original
            for m, value in zip(modules, saved):
                m.IS_HIP = value


def compile_all(targets: list[str], cases: list[str], sass: bool = False) -> list[Report]:
    reports: list[Report] = []
    for target_name in targets:
        seen: set = set()
        for case in cases:
            with _CompileInsteadOfLaunch(target_name, case, reports, seen, sass).active():
                CASES[case](target_name)
    return reports


def failures(reports: list[Report]) -> list[str]:
    out = []
    for r in reports:
        limit = TARGETS[r.target].shared_limit
        if r.error:
            out.append(f"{r.case} / {r.kernel} on {r.target}: {r.error}")
        elif r.spilled_bytes:
            out.append(f"{r.case} / {r.kernel} on {r.target}: spills ({r.spilled_bytes})")
        elif r.shared > limit:
            out.append(f"{r.case} / {r.kernel} on {r.target}: {r.shared} B shared > {limit}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--quick", action="store_true", help="one case per kernel family")
    parser.add_argument("--cases", default="", help="only the cases whose name contains this")
    parser.add_argument("--sass", action="store_true", help="sm_90 main-loop instructions by opcode")
    args = parser.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    if "sm90" in targets and "TRITON_PTXAS_PATH" not in os.environ:
        print("compile_kernels: no ptxas found (set TRITON_PTXAS_PATH): skipping sm90")
        targets.remove("sm90")
    cases = [c for c in (QUICK_CASES if args.quick else CASES) if args.cases in c]
    reports = compile_all(targets, cases, args.sass)
    print("| case | kernel | target | regs | spills | shared B |\n|---|---|---|---:|---:|---:|")
    for r in reports:
        print(f"| {r.case} | {r.kernel} | {r.target} | {r.registers} | {r.spilled_bytes} | {r.shared} |"
              + (f" ERROR {r.error}" if r.error else ""))
    for r in reports:
        if r.loop_sass:
            opcodes = ", ".join(f"{op} {n}" for op, n in r.loop_sass.most_common())
            print(f"loop SASS | {r.case} | {r.kernel} | {sum(r.loop_sass.values())} | {opcodes} | "
                  f"before / after the loop {r.outside_loop[0]} / {r.outside_loop[1]} |")
    failed = failures(reports)
    for line in failed:
        print("FAIL", line)
    print(f"{len(reports)} compiled variants, {len(failed)} failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
