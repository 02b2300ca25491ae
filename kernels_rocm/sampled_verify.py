"""A sampled step's verification in two kernels: rejection sampling against a greedy draft, then the
accepted prefix and the tokens each sequence emits.

model_ops.sampling.verify at temperature > 0 runs ~30-50 small torch ops outside the decode graphs
(processed_probs, the draft gathers, the acceptance test, the residual, the exponential race, then
DraftLayout.verified); a small model's steps are host-bound, so each is host time: SmolLM2-135M's
EAGLE3 step at batch 1 on an H100 host took 1.17 ms at k = 0 and 2.38 ms at k = 1 at temperature 1
(issue #19). For the common case (every row sampled, no top-k / top-p, a greedy draft: q is the
draft's one-hot) this does the arithmetic after the noise in two launches:

1. one program per logits row (grid: sequences x (K + 1), programs past a sequence's rows idle):
   p = softmax(logits / T) in fp32 (an online max and sum, then a second pass over the vocabulary);
   a draft row accepts its draft d when u < min(p(d), 1) and emits argmax_v p_v / E_v over the
   residual max(p - q, 0) = p without d (when that is empty, p(d) == 1, over p itself: d); a
   sequence's last row emits its bonus token from all of p;
2. kernels_rocm.greedy_verify with those flags: the accepted prefix and the padded token rows.

The noise u [D] and E [R, V] is drawn by the caller with the torch path's own calls in its order, so
a seed gives the same tokens on either path (model_ops.sampling._rejection_sample is the oracle).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_rocm import _pdl as pdl
from kernels_rocm._pdl import wait_for_previous_kernel
from kernels_rocm._util import check_dim, check_same_device, check_tensor
from kernels_rocm.greedy_verify import greedy_verify

BLOCK_V = 1024  # vocabulary entries a program reads per iteration (8 a thread at 4 warps)
NUM_WARPS = 4


@triton.jit(do_not_specialize=["stride", "width", "vocab"])
def _sampled_rows_kernel(
    logits_ptr, stride, temperature_ptr, uniform_ptr, noise_ptr, draft_ids_ptr, row_index_ptr, draft_index_ptr,
    valid_ptr, emitted_ptr, accept_ptr, width, vocab,
    W_PAD: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    s = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    k = tl.arange(0, W_PAD)
    drafts = tl.sum((tl.load(valid_ptr + s * width + k, mask=k < width, other=0) != 0).to(tl.int32), axis=0)
    if j <= drafts:  # row j of sequence s exists: it scores the token after its first j drafts
        row = tl.load(row_index_ptr + s * (width + 1) + j)
        is_draft = j < drafts
        index = tl.load(draft_index_ptr + s * width + j, mask=is_draft, other=0)
        draft = tl.load(draft_ids_ptr + index, mask=is_draft, other=-1)
        temperature = tl.load(temperature_ptr + row)
        logits_row = logits_ptr + row * stride
        noise_row = noise_ptr + row * vocab
        offs = tl.arange(0, BLOCK_V)

        # softmax statistics: a running max and sum of exp per lane. The max starts at the lowest finite
        # float, not -inf, so that a -inf logit (a masked token) never gives exp(-inf - -inf) = NaN
        lane_max = tl.full([BLOCK_V], -3.4028234663852886e38, tl.float32)
        lane_sum = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, vocab, BLOCK_V):
            v = start + offs
            # IEEE division as torch's logits / T (Triton's `/` on fp32 is an approximate divide)
            x = tl.math.div_rn(tl.load(logits_row + v, mask=v < vocab, other=float("-inf")).to(tl.float32), temperature)
            new_max = tl.maximum(lane_max, x)
            lane_sum = lane_sum * tl.exp(lane_max - new_max) + tl.exp(x - new_max)
            lane_max = new_max
        top = tl.max(lane_max, axis=0)
        total = tl.sum(lane_sum * tl.exp(lane_max - top), axis=0)

        # the exponential race over the residual: argmax p_v / E_v, the draft's entry left out
        best = tl.full([BLOCK_V], -1.0, tl.float32)
        best_at = tl.zeros([BLOCK_V], tl.int32)
        for start in range(0, vocab, BLOCK_V):
            v = start + offs
            live = v < vocab
            x = tl.math.div_rn(tl.load(logits_row + v, mask=live, other=float("-inf")).to(tl.float32), temperature)
            p = tl.math.div_rn(tl.exp(x - top), total)
            score = tl.where(live & (v != draft), tl.math.div_rn(p, tl.load(noise_row + v, mask=live, other=1.0)), -1.0)
            better = score > best  # strict: a lane keeps its first maximum, as torch.argmax
            best = tl.where(better, score, best)
            best_at = tl.where(better, v, best_at)
        high = tl.max(best, axis=0)
        first = tl.min(tl.where(best == high, best_at, vocab), axis=0)
        # an empty residual (every other p_v == 0: p(d) == 1) samples p itself, whose only mass is d
        tl.store(emitted_ptr + row, tl.where((high > 0) | (draft < 0), first, draft).to(tl.int64))

        x_draft = tl.load(logits_row + draft, mask=is_draft, other=float("-inf")).to(tl.float32)
        p_draft = tl.math.div_rn(tl.exp(tl.math.div_rn(x_draft, temperature) - top), total)
        u = tl.load(uniform_ptr + index, mask=is_draft, other=2.0)
        tl.store(accept_ptr + index, (u < tl.minimum(p_draft, 1.0)).to(tl.int8), mask=is_draft)


def sampled_verify(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, noise: torch.Tensor,
                   draft_ids: torch.Tensor, row_index: torch.Tensor, draft_index: torch.Tensor,
                   valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [S, K + 1], accepted counts [S]) of a sampled step as model_ops.sampling.verify gives
    them with q one-hot and no top-k / top-p. logits [R, V] (any float dtype, upcast to fp32);
    temperature [R] fp32, every entry > 0; uniform [D] fp32: each draft's U[0, 1); noise [R, V] fp32:
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
    emitted = torch.empty(rows, dtype=torch.int64, device=logits.device)
    accept = torch.empty(draft_ids.shape[0], dtype=torch.int8, device=logits.device)
    if num_seqs:
        _sampled_rows_kernel[(num_seqs, width + 1)](
            logits, logits.stride(0), temperature, uniform, noise.contiguous(), draft_ids, row_index.contiguous(),
            draft_index.contiguous(), valid.contiguous().view(torch.int8), emitted, accept, width, vocab,
            W_PAD=triton.next_power_of_2(max(width, 1)), BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
            **pdl.launch_args(logits.device))
    return greedy_verify(emitted, draft_ids, row_index, draft_index, valid, accept=accept)


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
