"""Fused MoE over MXFP4 experts (Quark's released layout), activation QDQ fused in.

    a = qdq_mxfp4(x) if quantize_activations else x
    per (token t, slot k), e = topk_ids[t, k]:
        h = silu(a[t] @ W13[e][:I]^T) * (a[t] @ W13[e][I:]^T)      fp32, rounded to x's dtype
        h = qdq_mxfp4(h) if quantize_activations
        out[t] += topk_weights[t, k] * (h @ W2[e]^T)

Up to `decode_max_tokens(I, W4A4)` tokens `fused_moe_mxfp4` takes the GEMV-style decode path instead
(`mxfp4_moe_decode`: no alignment, no tl.dot, two launches, and two quantize launches with W4A4), then
with W4A4 on NVIDIA up to EXPERT_GEMV_MAX_TOKENS the expert-grouped GEMVs (`mxfp4_moe_expert_gemv`:
the decode path's integer dots over blocks of one expert's pairs). The grouped path follows the
structure of `fused_moe` (same routing alignment, `moe_align_block_size`): pairs sorted by
expert and padded to BLOCK_M, a grouped GEMM over (M block, N tile) programs that exit past the
used length, then the sum over a token's K rows. The MXFP4 parts (see `_mxfp4`):
- weights: packed bytes and E8M0 scales are read and dequantized in registers; with decode's
  one or two pairs per expert every weight byte is read once per expert hit;
- with MXFP4 activations x is QDQ'd once per call (`qdq_rows`, one launch) and GEMM 1 reads
  it ready to use: QDQ'ing each activation tile on load repeated it in every N tile of GEMM 1 and
  cost 7-11% of the whole call at T = 64-512 (H100, docs/benchmarks.md section 6, 2026-11-27);
  GEMM 1 ends with silu(gate) * up, rounded to x's dtype and QDQ'd per 32 columns (its N tile is
  a multiple of 32): GEMM 2 reads h ready to use;
- decode (T <= 32 tokens x top-8) touches few experts and GEMM 1 has few columns (2I = 512 per
  Kimi TP8 rank) against a long K (7168): its tiles alone cannot fill the GPU, so K is split
  over SPLIT_K programs writing fp32 partials and `_gate_up_splits_kernel` sums them in a fixed
  order before the same epilogue (deterministic). GEMM 2 has N = H columns: never split.
- GEMM 2's programs can walk several consecutive N tiles (`MoeConfig.down_n_tiles`): with
  K = I = 256 a one-tile program has 2 K steps, so its setup and pipeline fill are paid per tile;
  a walking program pays them once (NVIDIA default at decode-sized M blocks: `default_config`);
- the K partial outputs of a token are written in x's dtype and summed in fp32 (torch.sum),
  as `fused_moe` does: exact in fp32; in bf16 each partial is rounded once before the sum.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels_rocm._mxfp4 import (
    MX_BLOCK,
    check_mxfp4_weight,
    load_activation,
    mxfp4_dot,
    qdq_mxfp4_blocks,
    silu_mul,
)
from kernels_rocm._util import (
    IS_HIP,
    SUPPORTED_DTYPES,
    check_dim,
    check_same_device,
    check_tensor,
    dot_precision,
)
from kernels_rocm.fused_moe import choose_block_m, moe_align_block_size
from kernels_rocm.mxfp4_linear import GemmConfig, choose_split_k, dot_dtype, ptx_decode, split_k_range
from kernels_rocm.mxfp4_moe_decode import DecodeConfig, fused_moe_mxfp4_decode
from kernels_rocm.mxfp4_moe_expert_gemv import ExpertGemvConfig, fused_moe_mxfp4_expert_gemv

# Up to this many tokens fused_moe_mxfp4 takes the GEMV-style decode path (mxfp4_moe_decode).
# Measured on an H100 (docs/benchmarks.md section 6, ci/bench_mxfp4_decode.py). With bf16
# activations (W4A16) decode beats the grouped GEMMs at T = 1..4 on both Kimi shapes (TP8 rank at
# T = 1: 31.0 against 48.9 us), loses from T = 8 at full width (I = 2048) and wins up to 16 with a
# TP8 rank's narrow experts (I = 256). With MXFP4 activations (W4A4, the released Kimi-K2.5) the
# decode kernels multiply codes by codes (integer dots) and win far longer (2026-11-23): TP8 rank
# 268 against 480 us at T = 32, 498 / 718 at 64, 693 / 796 at 96, 906 / 876 at 128; full width
# 1971 / 3004 at 32, 3869 / 4811 at 64, 5755 / 5271 at 96.
# From 2026-11-23 (later) W4A4 hands the middle range to the expert-grouped GEMVs, which read an
# expert once per block of its pairs (ci/bench_mxfp4_expert_gemv.py, H200): TP8 rank 360 against the
# decode path's 373 us at T = 48, 443 / 486 at 64, 652 / 922 at 128; full width 1770 / 1917 at 32. The
# decode path stays ahead up to 32 tokens on the TP8 rank (260 / 276 us) and 16 at full width.
# From 2026-11-27 the decode path's launch shape follows the token count (mxfp4_moe_decode.default_config)
# and W4A4 takes it again up to 96 tokens on the TP8 rank (H100, ci/bench_mxfp4_expert_gemv.py: 532
# against the expert-grouped GEMVs' 578 us at T = 96, 679 / 656 at 128) and 64 at full width (2808 /
# 3096 at 64, 4245 / 3927 at 96).
DECODE_MAX_TOKENS = {False: 4, True: 64}  # by quantize_activations, experts wider than NARROW_INTER
DECODE_MAX_TOKENS_NARROW = {False: 16, True: 96}
# ROCm has no expert-grouped path: there W4A4 keeps the decode path as far as it beat the grouped GEMMs
# (H100: TP8 rank 693 against 796 us at T = 96, full width 3869 / 4811 at 64), by narrow experts or not
W4A4_DECODE_MAX_TOKENS_ALONE = {True: 96, False: 64}
NARROW_INTER = 256


# With MXFP4 activations, from past the decode path up to this many tokens the expert-grouped GEMV
# path (mxfp4_moe_expert_gemv) runs, by narrow experts (intermediate <= NARROW_INTER) or not; then the
# grouped GEMMs (H200, ci/bench_mxfp4_expert_gemv.py: TP8 rank 818 against 934 us at T = 192, 912 / 939
# at 224, 992 / 952 at 256, and in the Kimi step with the shared expert fused, c64 k = 3's 256-token
# verify took 82.7 ms through it against 77.1 on the grouped GEMMs; full width 5128 / 5961 at 192,
# 5704 / 5990 at 224, 6211 / 6100 at 256).
EXPERT_GEMV_MAX_TOKENS = {True: 192, False: 192}


def decode_max_tokens(inter: int, quantize_activations: bool) -> int:
    """The most tokens the decode path takes for experts of intermediate size `inter`."""
    if quantize_activations and IS_HIP:
        return W4A4_DECODE_MAX_TOKENS_ALONE[inter <= NARROW_INTER]
    table = DECODE_MAX_TOKENS_NARROW if inter <= NARROW_INTER else DECODE_MAX_TOKENS
    return table[quantize_activations]


def _path(num_tokens: int, inter: int, quantize_activations: bool) -> str:
    """"decode", "expert_gemv" or "grouped" for a call without a config."""
    if num_tokens <= decode_max_tokens(inter, quantize_activations):
        return "decode"
    # NVIDIA only: compiled for gfx942 / gfx950 the portable integer dots spill VGPRs (ci/compile_kernels.py)
    if quantize_activations and not IS_HIP and num_tokens <= EXPERT_GEMV_MAX_TOKENS[inter <= NARROW_INTER]:
        return "expert_gemv"
    return "grouped"


@dataclass(frozen=True)
class MoeConfig:
    """Launch configuration of both grouped GEMMs (block_m is shared: one routing alignment).
    down_n_tiles: consecutive N tiles each GEMM-2 program walks (1: one tile a program, the
    default; > 1 amortizes the program's setup and pipeline fill over tiles of a short K)."""

    gate_up: GemmConfig
    down: GemmConfig
    down_n_tiles: int = 1


PREFILL_PAIRS_PER_EXPERT = 32


def prefill_config(pairs_per_expert: float) -> MoeConfig:
    """NVIDIA tiles for more than PREFILL_PAIRS_PER_EXPERT pairs an expert: 64-row M blocks with 128 x 64
    tiles in both GEMMs up to 64 pairs an expert, then 128-row blocks (GEMM 1 128 x 128 on 8 warps,
    GEMM 2 256 x 64 on 8 warps). H100 sweep, W4A4 (docs/benchmarks.md section 6, "MXFP4 GEMMs at
    prefill sizes"): Kimi TP8 T = 2,048 / 4,096 / 8,192 1.44x / 1.58x / 1.38x the 32- and 64-row
    tiles of `default_config`, full width T = 8,192 1.34x; up to 32 pairs an expert (T = 512 / 1,024)
    those stay ahead. W4A16 takes the same tiles (not swept)."""
    if pairs_per_expert <= 64:
        tile = GemmConfig(64, 128, 64, 1, num_warps=4, num_stages=3)
        return MoeConfig(tile, tile)
    return MoeConfig(GemmConfig(128, 128, 128, 1, num_warps=8, num_stages=3),
                     GemmConfig(128, 256, 64, 1, num_warps=8, num_stages=3))


def default_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                   device: torch.device, dtype: torch.dtype = torch.bfloat16) -> MoeConfig:
    """64 gate + 64 up rows per GEMM 1 program (each activation tile is loaded and QDQ'd for more
    weight rows: 2-15% faster than 32 in the H100 sweeps of ci/bench_mxfp4.py), K tiles of 128;
    GEMM 1 split along K while the grid is small. GEMM 2: on NVIDIA with 16-row M blocks, programs
    of 4 N tiles of 128 columns (H100 sweep: 12% faster at Kimi TP8 T = 256 / 512, whose K = 256
    is two tiles, so setup and pipeline fill dominated a one-tile program; 0.6-2% at full width);
    elsewhere, and on AMD where it was never measured, one tile of 64 columns a program.
    Prefill-sized calls on NVIDIA (more than 32 pairs an expert) with 16-bit activations (`dtype`):
    `prefill_config`. With fp32 activations (the GPU tests' fp32 models) its 128-row GEMM 1 needs 288 KB
    of shared memory, above sm_90's 227 (tests/gpu/test_mxfp4_gpu.py failed to launch it): fp32 keeps
    the tiles below."""
    num_pairs = num_tokens * top_k
    if not IS_HIP and dtype.itemsize == 2 and num_pairs > PREFILL_PAIRS_PER_EXPERT * num_experts:
        return prefill_config(num_pairs / num_experts)
    block_m = choose_block_m(num_pairs, num_experts)
    stages = 2 if IS_HIP else 3
    # M blocks in use: about one per expert hit while experts get <= block_m pairs each
    m_blocks = min(triton.cdiv(num_pairs, block_m) + num_experts, num_pairs)
    gate_up_tiles = m_blocks * triton.cdiv(inter, 64)
    split = choose_split_k(gate_up_tiles, hidden, 128, device)
    gate_up = GemmConfig(block_m, 64, 128, split, num_warps=4, num_stages=stages)
    if block_m == 16 and not IS_HIP:
        return MoeConfig(gate_up, GemmConfig(block_m, 128, 128, 1, num_warps=4, num_stages=stages), down_n_tiles=4)
    return MoeConfig(gate_up, GemmConfig(block_m, 64, 128, 1, num_warps=4, num_stages=stages))


@triton.jit
def _gate_up_epilogue(gate, up, QUANTIZE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """silu(gate) * up (fp32) rounded to the activation dtype, then MXFP4 QDQ'd if QUANTIZE."""
    h = silu_mul(gate, up, OUT_DTYPE)
    if QUANTIZE:
        h = qdq_mxfp4_blocks(h.to(tl.float32), ROWS, COLS).to(OUT_DTYPE)
    return h


@triton.jit
def _k_step(acc, acc_up, a_rows, pair_valid, w_rows, s_rows, n_valid, k0, N, K, stride_wn, stride_sn,
            GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, PTX_DECODE: tl.constexpr,
            SCALES_FOLD: tl.constexpr, EVEN_K: tl.constexpr):
    """One K tile of a program's (gate and up, or down) accumulators."""
    offs_k = tl.arange(0, BLOCK_K)
    a = load_activation(
        a_rows + k0 + offs_k[None, :], pair_valid[:, None] & (k0 + offs_k < K)[None, :],
        False, BLOCK_M, BLOCK_K, DOT_DTYPE,
    )
    acc = mxfp4_dot(acc, a, w_rows, s_rows, n_valid, k0, K,
                    BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION, PTX_DECODE, SCALES_FOLD, EVEN_K)
    if GATE_UP:
        acc_up = mxfp4_dot(acc_up, a, w_rows + N * stride_wn, s_rows + N * stride_sn, n_valid, k0, K,
                           BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, DOT_PRECISION, PTX_DECODE, SCALES_FOLD, EVEN_K)
    return acc, acc_up


@triton.jit
def _store_tile(c_ptr, acc, acc_up, routed, pair, pair_valid, offs_n, n_valid, stride_cm,
                GATE_UP: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, QUANTIZE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The unsplit epilogue of one (M block, N tile): silu(gate) * up, or times the routed weights
    `routed` [BLOCK_M], stored."""
    if GATE_UP:
        out = _gate_up_epilogue(acc, acc_up, QUANTIZE, BLOCK_M, BLOCK_N, c_ptr.dtype.element_ty)
    else:
        out = acc
    if MUL_ROUTED_WEIGHT:
        out = out * routed[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :], out.to(c_ptr.dtype.element_ty),
             mask=pair_valid[:, None] & n_valid[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _mxfp4_moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, c_ptr, part_ptr, topk_weights_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_pairs, N, K,
    stride_am: tl.int64, stride_we: tl.int64, stride_wn: tl.int64,
    stride_se: tl.int64, stride_sn: tl.int64, stride_cm: tl.int64,
    A_ROWS_PER_PAIR_DIV: tl.constexpr,  # activation row = pair id // this (top_k for x, 1 for h)
    GATE_UP: tl.constexpr,  # weight rows [0, N) are gate, [N, 2N) up; epilogue silu(gate) * up
    MUL_ROUTED_WEIGHT: tl.constexpr,
    QUANTIZE: tl.constexpr,  # QDQ h in the GATE_UP epilogue (the activation, x or h, is read QDQ'd)
    SPLIT_K: tl.constexpr,  # > 1: write fp32 partials [SPLIT_K, num_pairs, 2N] (GATE_UP only)
    N_TILES: tl.constexpr,  # N tiles a program owns (consecutive); > 1: one loop over (tile, K step)
    K_TILES: tl.constexpr,  # cdiv(K, BLOCK_K), for N_TILES > 1 (a constant divisor: shifts, no division)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, PTX_DECODE: tl.constexpr,
    SCALES_FOLD: tl.constexpr,  # every scale byte of w <= 128 (`foldable_scales`)
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0 (`mxfp4_dot`)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair_valid = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    a_rows = a_ptr + (pair // A_ROWS_PER_PAIR_DIV)[:, None] * stride_am
    w_expert = w_ptr + expert * stride_we
    s_expert = s_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MUL_ROUTED_WEIGHT:  # one load for every N tile of the program
        routed = tl.load(topk_weights_ptr + pair, mask=pair_valid, other=0.0)
    else:
        routed = tl.full([BLOCK_M], 1.0, tl.float32)

    if N_TILES == 1:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = offs_n < N
        w_rows = w_expert + offs_n.to(tl.int64) * stride_wn
        s_rows = s_expert + offs_n.to(tl.int64) * stride_sn
        first, last = split_k_range(K, split, BLOCK_K, SPLIT_K)
        for tile in range(first, last):
            acc, acc_up = _k_step(acc, acc_up, a_rows, pair_valid, w_rows, s_rows, n_valid, tile * BLOCK_K, N, K,
                                  stride_wn, stride_sn, GATE_UP, BLOCK_M, BLOCK_N, BLOCK_K,
                                  DOT_DTYPE, DOT_PRECISION, PTX_DECODE, SCALES_FOLD, EVEN_K)
        if SPLIT_K > 1:
            part = part_ptr + (split * num_pairs + pair)[:, None] * (2 * N) + offs_n[None, :]
            mask = pair_valid[:, None] & n_valid[None, :]
            tl.store(part, acc, mask=mask)
            tl.store(part + N, acc_up, mask=mask)
        else:
            _store_tile(c_ptr, acc, acc_up, routed, pair, pair_valid, offs_n, n_valid, stride_cm,
                        GATE_UP, MUL_ROUTED_WEIGHT, QUANTIZE, BLOCK_M, BLOCK_N)
    else:
        # GEMM 2 has K = I (256 on a Kimi TP8 rank): 2 K steps per N tile. A program that walks
        # N_TILES tiles in one flattened (tile, K step) loop pays the pair ids, expert, pointers
        # and routed weights once and keeps the pipeline full across tiles (the next tile's loads
        # issue during this tile's decode); its activation rows are re-read (L2) every tile.
        # The tile and K step come from the flat index and the constexpr K_TILES: Triton 3.6
        # pipelines this loop with 3 stages (sm_90 SASS); with the indices carried through the
        # store's if-branch it pipelined nothing, and as a nested tl.range(flatten=True) loop only
        # the activation loads (the weights then waited on plain loads).
        tl.static_assert(SPLIT_K == 1, "a program that walks N tiles is never split along K")
        first_tile = pid_n * N_TILES
        tiles = tl.minimum(N_TILES, tl.cdiv(N, BLOCK_N) - first_tile)
        for step in range(tiles * K_TILES):
            k_tile = step % K_TILES
            offs_n = (first_tile + step // K_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_valid = offs_n < N
            w_rows = w_expert + offs_n.to(tl.int64) * stride_wn
            s_rows = s_expert + offs_n.to(tl.int64) * stride_sn
            acc, acc_up = _k_step(acc, acc_up, a_rows, pair_valid, w_rows, s_rows, n_valid, k_tile * BLOCK_K, N, K,
                                  stride_wn, stride_sn, GATE_UP, BLOCK_M, BLOCK_N, BLOCK_K,
                                  DOT_DTYPE, DOT_PRECISION, PTX_DECODE, SCALES_FOLD, EVEN_K)
            if k_tile == K_TILES - 1:
                _store_tile(c_ptr, acc, acc_up, routed, pair, pair_valid, offs_n, n_valid, stride_cm,
                            GATE_UP, MUL_ROUTED_WEIGHT, QUANTIZE, BLOCK_M, BLOCK_N)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


@triton.jit
def _qdq_rows_kernel(x_ptr, y_ptr, stride_x: tl.int64, stride_y: tl.int64, width, BLOCK: tl.constexpr):
    """y[row] = qdq_mxfp4(x[row]) in x's dtype (`load_activation`), once per call for GEMM 1."""
    row = tl.program_id(0).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = cols < width  # width is a multiple of 32: the masked tail holds whole blocks
    y = load_activation(x_ptr + row * stride_x + cols, mask, True, 1, BLOCK, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


def qdq_rows(x: torch.Tensor) -> torch.Tensor:
    """qdq_mxfp4 of each row of x [M, W] (W a multiple of 32) in one launch, in x's dtype."""
    y = torch.empty_like(x)
    if x.numel():
        block = min(1024, triton.next_power_of_2(x.shape[1]))
        _qdq_rows_kernel[(x.shape[0], triton.cdiv(x.shape[1], block))](
            x, y, x.stride(0), y.stride(0), x.shape[1], BLOCK=block, num_warps=4)
    return y


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_splits_kernel(
    part_ptr, h_ptr, num_pairs, N, stride_hm: tl.int64,
    QUANTIZE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):
    """h[pair] = epilogue(sum over splits of the gate and up partials), splits summed in order."""
    pair = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        row = part_ptr + (s * num_pairs + pair) * (2 * N)
        gate += tl.load(row + offs, mask=valid, other=0.0)
        up += tl.load(row + N + offs, mask=valid, other=0.0)
    h = _gate_up_epilogue(gate[None, :], up[None, :], QUANTIZE, 1, BLOCK, h_ptr.dtype.element_ty)
    tl.store(h_ptr + pair * stride_hm + offs[None, :], h, mask=valid[None, :])


def _launch_gemm(
    a: torch.Tensor, w: torch.Tensor, s: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n: int, a_rows_per_pair_div: int,
    gate_up: bool, quantize: bool, cfg: GemmConfig, fold_scales: bool, n_tiles: int = 1,
) -> None:
    sorted_ids, expert_ids, num_padded = routing
    num_pairs = c.shape[0]
    k = a.shape[1]
    part = c
    if cfg.split_k > 1:
        part = torch.empty(cfg.split_k, num_pairs, 2 * n, dtype=torch.float32, device=c.device)
    grid = (expert_ids.shape[0], triton.cdiv(triton.cdiv(n, cfg.block_n), n_tiles), cfg.split_k)
    _mxfp4_moe_gemm_kernel[grid](
        a, w, s, c, part, topk_weights,
        sorted_ids, expert_ids, num_padded,
        num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), c.stride(0),
        A_ROWS_PER_PAIR_DIV=a_rows_per_pair_div, GATE_UP=gate_up, MUL_ROUTED_WEIGHT=not gate_up,
        QUANTIZE=quantize, SPLIT_K=cfg.split_k, N_TILES=n_tiles,
        K_TILES=triton.cdiv(k, cfg.block_k) if n_tiles > 1 else 1,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_DTYPE=dot_dtype(a.dtype), DOT_PRECISION=dot_precision(a.dtype), PTX_DECODE=ptx_decode(a.dtype),
        SCALES_FOLD=fold_scales, EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if cfg.split_k > 1:
        block = min(256, triton.next_power_of_2(n))
        _gate_up_splits_kernel[(num_pairs, triton.cdiv(n, block))](
            part, c, num_pairs, n, c.stride(0), QUANTIZE=quantize, SPLIT_K=cfg.split_k, BLOCK=block,
        )


def _check_inputs(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids) -> None:
    check_tensor("x", x, 2, SUPPORTED_DTYPES)
    check_tensor("w13", w13, 3)
    check_tensor("w2", w2, 3)
    check_tensor("topk_weights", topk_weights, 2, (torch.float32,))
    check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64))
    hidden = x.shape[1]
    if hidden % MX_BLOCK:
        raise ValueError(f"x has shape {tuple(x.shape)}: hidden size must be a multiple of {MX_BLOCK}")
    check_mxfp4_weight("w13", w13, w13_scale, "w13_scale", hidden)
    check_mxfp4_weight("w2", w2, w2_scale, "w2_scale")
    if w13.shape[1] % 2:
        raise ValueError(f"w13 has shape {tuple(w13.shape)}: dim 1 must be 2 * intermediate (gate rows, then up)")
    inter = w13.shape[1] // 2
    check_dim("w2", w2, 0, w13.shape[0], "w13's experts")
    check_dim("w2", w2, 1, hidden, "x's hidden size")
    check_dim("w2", w2, 2, inter // 2, "intermediate / 2 packed bytes, w13's dim 1 is 2 * intermediate")
    if inter % MX_BLOCK:
        raise ValueError(f"w13 has shape {tuple(w13.shape)}: intermediate size {inter} must be a multiple of {MX_BLOCK}")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_ids shape {tuple(topk_ids.shape)} must equal topk_weights shape {tuple(topk_weights.shape)}")
    check_dim("topk_ids", topk_ids, 0, x.shape[0], "x's tokens")
    if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        raise ValueError("topk_ids and topk_weights must be contiguous")
    check_same_device(x=x, w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale,
                      topk_weights=topk_weights, topk_ids=topk_ids)


def fused_moe_mxfp4(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    quantize_activations: bool,
    out: torch.Tensor | None = None,
    config: MoeConfig | DecodeConfig | ExpertGemvConfig | None = None,
    fold_scales: bool = False,
) -> torch.Tensor:
    """Routed MXFP4 experts: x [T, H] (bf16/fp16/fp32), w13 uint8 [E, 2I, H/2] (gate rows then up
    rows) with w13_scale uint8 E8M0 [E, 2I, H/32], w2 uint8 [E, H, I/2] with w2_scale [E, H, I/32],
    topk_weights [T, K] fp32, topk_ids [T, K] int32/int64 in [0, E). Returns [T, H] in x's dtype
    (or writes `out`). Graph-capturable. Up to decode_max_tokens(I, quantize_activations) tokens
    the decode path runs (`mxfp4_moe_decode`), with MXFP4 activations up to EXPERT_GEMV_MAX_TOKENS
    the expert-grouped GEMVs (`mxfp4_moe_expert_gemv`), else the grouped GEMMs; `config` overrides
    the choice (benchmarks): a MoeConfig forces the grouped GEMMs with those tiles, a DecodeConfig
    the decode path, an ExpertGemvConfig the expert-grouped GEMVs. (An int8 tensor-core W4A4 path was
    built and measured in two forms on 2026-11-27, slower than these at every T, and removed:
    docs/benchmarks.md section 6.) `fold_scales`: every E8M0 byte of w13_scale and w2_scale is <= 128
    (`_mxfp4.foldable_scales`, which the layers check once after loading); the grouped GEMMs then apply
    each scale in the weight decode's one multiply (mxfp4_dot). False is right for any weights."""
    _check_inputs(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must have x's shape {tuple(x.shape)} and dtype {x.dtype}, contiguous in its last dim, "
                         f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if num_tokens == 0:
        return out
    path = _path(num_tokens, inter, quantize_activations) if config is None else None
    if isinstance(config, DecodeConfig) or path == "decode":
        return fused_moe_mxfp4_decode(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids,
                                      quantize_activations, out, config)
    if isinstance(config, ExpertGemvConfig) or path == "expert_gemv":
        if not quantize_activations:
            raise ValueError("config: the expert-grouped GEMV path multiplies MXFP4 codes (quantize_activations=True)")
        return fused_moe_mxfp4_expert_gemv(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, out, config)

    cfg = config or default_config(num_tokens, top_k, num_experts, hidden, inter, x.device, x.dtype)
    if cfg.gate_up.block_m != cfg.down.block_m:
        raise ValueError(f"config: both GEMMs share one routing alignment, got block_m "
                         f"{cfg.gate_up.block_m} and {cfg.down.block_m}")
    if quantize_activations and cfg.gate_up.split_k == 1 and cfg.gate_up.block_n % MX_BLOCK:
        raise ValueError(f"config: the gate/up N tile must be a multiple of {MX_BLOCK} (h is QDQ'd per tile)")
    if cfg.down.split_k != 1:
        raise ValueError("config: the down GEMM is never split along K (it has H output columns)")
    if cfg.down_n_tiles < 1:
        raise ValueError(f"config: down_n_tiles must be >= 1, got {cfg.down_n_tiles}")
    num_pairs = num_tokens * top_k
    routing = moe_align_block_size(topk_ids, num_experts, cfg.gate_up.block_m)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    a = qdq_rows(x) if quantize_activations else x
    _launch_gemm(a, w13, w13_scale, h, topk_weights, routing, inter, top_k, True, quantize_activations, cfg.gate_up,
                 fold_scales)
    partial = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _launch_gemm(h, w2, w2_scale, partial, topk_weights, routing, hidden, 1, False, False, cfg.down,  # h is QDQ'd
                 fold_scales, cfg.down_n_tiles)
    torch.sum(partial.view(num_tokens, top_k, hidden), dim=1, out=out)
    return out
