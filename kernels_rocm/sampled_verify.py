"""A sampled step's verification in two kernels: rejection sampling against a greedy draft, then the
accepted prefix and the tokens each sequence emits.

model_ops.sampling.verify at temperature > 0 runs ~30-50 small torch ops outside the decode graphs
(processed_probs, the draft gathers, the acceptance test, the residual, the exponential race, then
DraftLayout.verified); a small model's steps are host-bound, so each is host time: SmolLM2-135M's
EAGLE3 step at batch 1 on an H100 host took 1.17 ms at k = 0 and 2.38 ms at k = 1 at temperature 1
(issue #19). For the common case (no top-k / top-p, a greedy draft: q is the draft's one-hot; rows
sampled, or greedy beside sampled ones) this does the arithmetic after the noise in two launches:

1. `_chunk_stats_kernel`, one program per (logits row, vocabulary chunk), in one pass over the
   chunk: the softmax statistics of x = log2(e) logits / T in fp32 (a running max and sum of 2^x),
   and the chunk's winner of the exponential race, argmax_v p_v / E_v = argmax_v x_v - log2 E_v (the
   same token: p_v is 2^x_v over a constant), the row's draft d left out (the residual max(p - q, 0)
   with q one-hot is p without d). A row is split into chunks only when there are few rows, so that
   a batch-1 step still spreads over the GPU;
2. `_sampled_tokens_kernel`, one program per sequence: merges its rows' chunks (p(d) from the
   statistics), accepts draft d when u < min(p(d), 1), takes each row's winner (a sequence's last row,
   the bonus, races over all of p), then the accepted prefix and the padded token row as
   kernels_rocm.greedy_verify.

The noise u [D] and E [R, V] is drawn by the caller with the torch path's own calls in its order, so
a seed gives the same tokens on either path (model_ops.sampling._rejection_sample is the oracle) but
where two candidates' p_v / E_v differ by a few ulps (the log-domain race rounds differently: a
probability of order 1e-6 a row). When the residual is empty (p(d) == 1 in fp32) the torch path
samples from p, i.e. d, as this does; the draft is then always accepted, so the token is never used.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import check_dim, check_same_device, check_tensor
from kernels_rocm.greedy_verify import store_verified

BLOCK_V = 1024  # vocabulary entries a program reads per iteration (8 a thread at 4 warps)
NUM_WARPS = 4
MAX_CHUNKS = 64  # chunks a row splits into at most
TARGET_PROGRAMS = 256  # rows x chunks a step aims for: ~2 programs per SM of an H100 or MI300
STATS = 4  # per (row, chunk): max x, sum exp(x - max), the race's best key, its token (exact in fp32)
# the lowest finite fp32: a running max that starts here never computes -inf - -inf (NaN) on a -inf
# logit (a masked token)
LOWEST: tl.constexpr = tl.constexpr(-3.4028234663852886e38)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # x / T is kept as log2(e) x / T: exp2 and log2 are one instruction


@triton.jit
def _row_of(valid_ptr, row_index_ptr, draft_index_ptr, draft_ids_ptr, s, j, width, W_PAD: tl.constexpr):
    """Sequence s's row j (any j; rows past its last are clamped to it): (its drafts, the logits
    row, whether it scores a draft, that draft's index in draft_ids, the draft or -1)."""
    k = tl.arange(0, W_PAD)
    drafts = tl.sum((tl.load(valid_ptr + s * width + k, mask=k < width, other=0) != 0).to(tl.int32), axis=0)
    row = tl.load(row_index_ptr + s * (width + 1) + j, mask=j <= width, other=0)
    is_draft = j < drafts
    index = tl.load(draft_index_ptr + s * width + j, mask=is_draft, other=0)
    draft = tl.load(draft_ids_ptr + index, mask=is_draft, other=-1)
    return drafts, row, is_draft, index, draft


@triton.jit
def _scale_of(t):
    """(whether a row of temperature t is greedy, its logits' scale): log2(e) / t for a sampled row; 1
    for a greedy one (t == 0), which races its raw logits without noise: its argmax, the first on ties."""
    greedy = t == 0.0
    return greedy, tl.where(greedy, 1.0, tl.math.div_rn(1.0, tl.where(greedy, 1.0, t)) * LOG2E)


@triton.jit(do_not_specialize=["stride", "width", "vocab", "chunk_len", "chunks"])
def _chunk_stats_kernel(
    logits_ptr, stride, temperature_ptr, noise_ptr, draft_ids_ptr, row_index_ptr, draft_index_ptr, valid_ptr,
    stats_ptr, width, vocab, chunk_len, chunks,
    W_PAD: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    s = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    c = tl.program_id(2)
    drafts, row, is_draft, index, draft = _row_of(valid_ptr, row_index_ptr, draft_index_ptr, draft_ids_ptr, s, j,
                                                  width, W_PAD)
    if j <= drafts:  # row j of sequence s exists (programs past its last row idle)
        greedy, scale = _scale_of(tl.load(temperature_ptr + row))
        draft_token = draft.to(tl.int32)
        logits_row = logits_ptr + row * stride
        noise_row = noise_ptr + row * vocab
        offs = tl.arange(0, BLOCK_V)
        lane_max = tl.full([BLOCK_V], LOWEST, tl.float32)
        lane_sum = tl.zeros([BLOCK_V], tl.float32)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_at = tl.zeros([BLOCK_V], tl.int32)
        end = tl.minimum(c * chunk_len + chunk_len, vocab)
        noise_end = tl.where(greedy, 0, end)  # a greedy row reads no noise
        for start in range(c * chunk_len, end, BLOCK_V):
            v = start + offs
            live = v < end
            x = tl.load(logits_row + v, mask=live, other=float("-inf")).to(tl.float32) * scale
            new_max = tl.maximum(lane_max, x)
            lane_sum = lane_sum * tl.math.exp2(lane_max - new_max) + tl.math.exp2(x - new_max)
            lane_max = new_max
            # the race in the log domain: no division; the draft's entry is not in the residual
            noise = tl.load(noise_row + v, mask=v < noise_end, other=1.0)
            key = tl.where(live & (v != draft_token), x - tl.math.log2(noise), float("-inf"))
            better = key > best  # strict: a lane keeps its first maximum, as torch.argmax
            best = tl.where(better, key, best)
            best_at = tl.where(better, v, best_at)
        top = tl.max(lane_max, axis=0)
        high = tl.max(best, axis=0)
        out = stats_ptr + (row * chunks + c) * 4  # STATS
        tl.store(out, top)
        tl.store(out + 1, tl.sum(lane_sum * tl.math.exp2(lane_max - top), axis=0))
        tl.store(out + 2, high)
        tl.store(out + 3, tl.min(tl.where(best == high, best_at, vocab), axis=0).to(tl.float32))


@triton.jit(do_not_specialize=["stride", "width", "chunks"])
def _sampled_tokens_kernel(
    logits_ptr, stride, temperature_ptr, uniform_ptr, draft_ids_ptr, row_index_ptr, draft_index_ptr, valid_ptr,
    stats_ptr, tokens_ptr, accepted_ptr, width, chunks,
    W_PAD: tl.constexpr, C_PAD: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    s = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, W_PAD)  # the sequence's rows: j = 0..width
    c = tl.arange(0, C_PAD)
    drafts, row, is_draft, index, draft = _row_of(valid_ptr, row_index_ptr, draft_index_ptr, draft_ids_ptr, s, j,
                                                  width, W_PAD)
    cells = stats_ptr + (row[:, None] * chunks + c[None, :]) * 4  # STATS
    live = (j[:, None] <= drafts) & (c[None, :] < chunks)
    chunk_max = tl.load(cells, mask=live, other=LOWEST)
    top = tl.max(chunk_max, axis=1)
    # a missing cell's sum of 1 weighs exp(LOWEST - top) = 0 in a row's total, and gives a row that does
    # not exist (top = LOWEST) a total above 0: no 0 / 0 below
    total = tl.sum(tl.load(cells + 1, mask=live, other=1.0) * tl.math.exp2(chunk_max - top[:, None]), axis=1)
    key = tl.load(cells + 2, mask=live, other=float("-inf"))
    high = tl.max(key, axis=1)
    # the first chunk holding the best key has the first such token
    winner = tl.min(tl.where(key == high[:, None], tl.load(cells + 3, mask=live, other=0.0), 3.0e38), axis=1)

    greedy, scale = _scale_of(tl.load(temperature_ptr + row, mask=j <= drafts, other=1.0))
    x_draft = tl.load(logits_ptr + row * stride + draft, mask=is_draft, other=float("-inf")).to(tl.float32) * scale
    p_draft = tl.math.exp2(x_draft - top) / total
    u = tl.load(uniform_ptr + index, mask=is_draft, other=2.0)
    # a greedy row's p is the one-hot of its argmax: d is accepted when it is the argmax (above the best
    # other logit, or level with it at a lower index: torch.argmax's first maximum), else the argmax
    # of the others is emitted, which then is the row's argmax
    is_argmax = (x_draft > high) | ((x_draft == high) & (draft < winner.to(tl.int64)))
    accept = is_draft & tl.where(greedy, is_argmax, u < tl.minimum(p_draft, 1.0))
    # an empty residual (p(d) == 1) samples from p itself, whose only mass is d
    emitted = tl.where(is_draft & (greedy == 0) & (p_draft >= 1.0), draft, winner.to(tl.int64))
    store_verified(tokens_ptr, accepted_ptr, s, j, width, draft, accept, emitted, W_PAD)


def sampled_verify(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, noise: torch.Tensor,
                   draft_ids: torch.Tensor, row_index: torch.Tensor, draft_index: torch.Tensor,
                   valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [S, K + 1], accepted counts [S]) of a sampled step as model_ops.sampling.verify gives
    them with q one-hot and no top-k / top-p. logits [R, V] (any float dtype, upcast to fp32);
    temperature [R] fp32, 0 for a greedy row; uniform [D] fp32: each draft's U[0, 1); noise [R, V] fp32:
    Exp(1) draws, clamped above 0; draft_ids [D]; row_index [S, K + 1], draft_index / valid [S, K]:
    the layout (model_ops.sampling.DraftLayout)."""
    check_tensor("logits", logits, 2, (torch.float32, torch.bfloat16, torch.float16), contiguous_last_dim=True)
    check_tensor("temperature", temperature, 1, (torch.float32,))
    check_tensor("uniform", uniform, 1, (torch.float32,))
    check_tensor("noise", noise, 2, (torch.float32,))
    check_tensor("draft_ids", draft_ids, 1, (torch.int64,))
    check_same_device(logits=logits, temperature=temperature, uniform=uniform, noise=noise, draft_ids=draft_ids,
                      row_index=row_index, draft_index=draft_index, valid=valid)
    rows, vocab = logits.shape
    check_dim("temperature", temperature, 0, rows, "a temperature per logits row")
    check_dim("uniform", uniform, 0, draft_ids.shape[0], "a uniform per draft")
    if noise.shape != logits.shape:
        raise ValueError(f"noise {tuple(noise.shape)}: expected the logits' shape {tuple(logits.shape)}")
    num_seqs, width = draft_index.shape
    # few rows (a small batch): split each row's vocabulary so that the step still fills the GPU
    wanted = min(MAX_CHUNKS, triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, max(rows, 1))))
    chunk_len = triton.cdiv(triton.cdiv(vocab, wanted), BLOCK_V) * BLOCK_V
    chunks = triton.cdiv(vocab, chunk_len)
    stats = torch.empty(rows, chunks, STATS, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(num_seqs, width + 1, dtype=torch.int64, device=logits.device)
    accepted = torch.empty(num_seqs, dtype=torch.int64, device=logits.device)
    if num_seqs:
        layout = (draft_ids, row_index.contiguous(), draft_index.contiguous(), valid.contiguous().view(torch.int8))
        w_pad, launch = triton.next_power_of_2(width + 1), pdl.launch_args(logits.device)
        _chunk_stats_kernel[(num_seqs, width + 1, chunks)](
            logits, logits.stride(0), temperature, noise.contiguous(), *layout, stats, width, vocab, chunk_len, chunks,
            W_PAD=w_pad, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS, **launch)
        _sampled_tokens_kernel[(num_seqs,)](
            logits, logits.stride(0), temperature, uniform, *layout, stats, tokens, accepted, width, chunks,
            W_PAD=w_pad, C_PAD=MAX_CHUNKS, **launch)
    return tokens, accepted


def precompile(device: torch.device, max_drafts: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """Compile both kernels for every draft width 1..max_drafts and each logits dtype (one launch each on
    scratch tensors; a width whose blocks are compiled already costs a launch), so that a sampled step
    never waits for a compile."""
    for dtype in dtypes:
        for width in range(1, max_drafts + 1):
            rows = width + 1
            sampled_verify(torch.zeros(rows, 8, dtype=dtype, device=device), torch.ones(rows, device=device),
                           torch.zeros(width, device=device), torch.ones(rows, 8, device=device),
                           torch.zeros(width, dtype=torch.int64, device=device),
                           torch.arange(rows, device=device)[None], torch.arange(width, device=device)[None],
                           torch.ones(1, width, dtype=torch.bool, device=device))
