"""A CPU emulation of the four aiter entry points atom_like calls (kernels_rocm.aiter_ops.AiterOps).

Written from what aiter's source says the functions take and compute (ROCm/aiter e4048607 and
amd-aiter 0.1.7.post2.dev18: aiter/mla.py mla_decode_fwd, csrc/py_itfs_cu/asm_mla.cu,
hsa/gfx9xx/mla/mla_asm.csv, aiter/fused_moe.py fused_moe / torch_moe_stage1, aiter/ops/shuffle.py
shuffle_weight, aiter/utility/fp4_utils.py e8m0_shuffle), not from its code: index arithmetic here
is derived independently, and every argument is checked the way the kernels need it (dtypes,
shapes, contiguity, the kernel table, the shuffled layouts), so an adapter that passes something
aiter would reject or misread fails here. It computes in fp32 and counts its calls.

What it cannot tell: anything about the kernels' own numerics, speed, or bugs.
"""
from __future__ import annotations

import functools
import math
from collections import Counter

import torch

from model_ops.quant.mxfp4 import dequantize_mxfp4, qdq_mxfp4

FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# keyword arguments of mla_decode_fwd that both aiter 0.1.7 and main accept (main inserted
# page_size and nhead_kv as the 9th/10th positional parameters, so nothing may go positionally past 8)
MLA_COMMON_KWARGS = {"sm_scale", "logit_cap", "num_kv_splits", "num_kv_splits_indptr", "work_meta_data", "work_indptr",
                     "work_info_set", "reduce_indptr", "reduce_final_map", "reduce_partial_map", "q_scale", "kv_scale"}


def _dtype_name(dtype: torch.dtype) -> str:
    return "fp8" if dtype in FP8 else {torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def mla_kernel_row(q_dtype: torch.dtype, kv_dtype: torch.dtype, gqa: int, qlen: int) -> tuple | None:
    """The non-persistent causal decode kernel row (q, kv, gqa, qSeqLen) asm_mla.cu dispatches a call
    to at gqa 16, on both gfx942 and gfx950 (rows present in both mla_asm.csv files), or None (abort)."""
    q, kv = _dtype_name(q_dtype), _dtype_name(kv_dtype)
    if gqa != 16:
        return None  # other widths exist per arch; the adapter only ever sends 16
    if (q, kv) == ("bf16", "bf16"):
        return (q, kv, 16, 1 if qlen == 1 else 4 if qlen <= 4 else 8 if qlen <= 8 else None)
    if (q, kv) == ("fp8", "fp8") and qlen <= 4:
        return (q, kv, 16, qlen if qlen <= 2 else 4)
    return None  # bf16 q with fp8 kv: persistent-mode kernels only


class EmulatedAiter:
    fp4x2 = torch.float4_e2m1fn_x2
    per_1x32 = "QuantType.per_1x32"
    silu = "ActivationType.Silu"

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.mla_args: list[dict] = []  # what each mla_decode_fwd call received

    # ------------------------------------------------------------------ MLA decode

    def mla_decode_fwd(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       **kwargs):
        self.calls["mla_decode_fwd"] += 1
        unknown = set(kwargs) - MLA_COMMON_KWARGS
        assert not unknown, f"keywords {unknown} are not in both aiter signatures"
        sm_scale, q_scale, kv_scale = kwargs.get("sm_scale"), kwargs.get("q_scale"), kwargs.get("kv_scale")
        assert kwargs.get("logit_cap", 0.0) <= 0, "logit_cap is not supported"
        assert kwargs.get("work_meta_data") is None, "the emulation covers the non-persistent mode"
        assert q.dim() == 3 and q.is_contiguous(), "asm_mla.cu: Q must be contiguous [total_s, nhead, D]"
        assert kv_buffer.dim() == 4, "kv_buffer is [num_pages, page_size, nhead_kv, D]"
        num_pages, page_size, nhead_kv, head_dim = kv_buffer.shape
        assert nhead_kv == 1 and head_dim == q.shape[-1]
        total_s, nhead, v_dim = o.shape
        assert o.is_contiguous() and o.dtype == torch.bfloat16 and total_s == q.shape[0] and nhead == q.shape[1]
        assert v_dim < head_dim
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                        ("kv_last_page_lens", kv_last_page_lens)):
            assert t.dtype == torch.int32 and t.dim() == 1, f"{name} must be a 1-D int32 tensor"
        bs = qo_indptr.shape[0] - 1
        assert kv_indptr.shape[0] == bs + 1 and kv_last_page_lens.shape[0] == bs
        assert isinstance(max_seqlen_q, int)
        assert mla_kernel_row(q.dtype, kv_buffer.dtype, nhead, max_seqlen_q) is not None, \
            f"no non-persistent kernel for q {q.dtype}, kv {kv_buffer.dtype}, {nhead} heads, qlen {max_seqlen_q}"
        # the kernel finds batch b's queries at row b * max_seqlen_q (stride_Q = row stride * max_seqlen_q)
        assert total_s == bs * max_seqlen_q
        assert torch.equal(qo_indptr, torch.arange(bs + 1, dtype=torch.int32) * max_seqlen_q)
        if q.dtype in FP8:
            assert kv_buffer.dtype == q.dtype and q_scale is not None and kv_scale is not None, \
                "fp8 Q requires q_scale and kv_scale"
        for s in (q_scale, kv_scale):
            assert s is None or (s.dtype == torch.float32 and s.numel() == 1)
        self.mla_args.append(dict(q=q, kv_indptr=kv_indptr.clone(), kv_indices=kv_indices.clone(),
                                  kv_last_page_lens=kv_last_page_lens.clone(), max_seqlen_q=max_seqlen_q,
                                  sm_scale=sm_scale, q_scale=q_scale, kv_scale=kv_scale))

        qf = q.float() * (q_scale.float() if q.dtype in FP8 else 1.0)
        row_scale = kv_scale.float() if kv_buffer.dtype in FP8 else 1.0
        sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
        lse = torch.empty(total_s, nhead)
        for b in range(bs):
            pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
            assert len(pages) > 0 and 1 <= int(kv_last_page_lens[b]) <= page_size
            assert int(pages.min()) >= 0 and int(pages.max()) < num_pages
            kv_len = (len(pages) - 1) * page_size + int(kv_last_page_lens[b])
            # [kv_len, D]: pages in order, tokens in page order
            keys = kv_buffer[pages].flatten(0, 1)[:kv_len, 0].float() * row_scale
            qb = qf[b * max_seqlen_q:(b + 1) * max_seqlen_q]  # [qlen, nhead, D]
            scores = torch.einsum("qhd,kd->qhk", qb, keys) * sm_scale
            # causal: query row j of the last max_seqlen_q positions sees keys up to kv_len - qlen + j
            visible = torch.arange(kv_len)[None, :] <= (kv_len - max_seqlen_q + torch.arange(max_seqlen_q))[:, None]
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            out = torch.einsum("qhk,kd->qhd", scores.softmax(-1), keys[:, :v_dim])
            o[b * max_seqlen_q:(b + 1) * max_seqlen_q] = out.to(o.dtype)
            lse[b * max_seqlen_q:(b + 1) * max_seqlen_q] = scores.logsumexp(-1)
        return o, lse

    # ------------------------------------------------------------------ shuffles

    @staticmethod
    @functools.cache
    def _weight_order(rows: int, cols: int) -> torch.Tensor:
        """Source flat index of each destination byte of shuffle_weight(layout=(16, 16)) on uint8
        [rows, cols]: 16-row x 32-byte tiles in row-block then column-block order; inside a tile,
        the first 16 bytes of its 16 rows (row by row), then their second 16 bytes."""
        d = torch.arange(rows * cols)
        kk, d = d % 16, d // 16
        nr, d = d % 16, d // 16
        kh, d = d % 2, d // 2
        kb, nb = d % (cols // 32), d // (cols // 32)
        return (nb * 16 + nr) * cols + kb * 32 + kh * 16 + kk

    def shuffle_weight(self, x, layout=(16, 16)):
        self.calls["shuffle_weight"] += 1
        assert layout == (16, 16) and x.dtype in (torch.uint8, self.fp4x2)
        rows, cols = x.shape[-2:]
        assert rows % 16 == 0 and cols % 32 == 0, "shuffle_weight needs N % 16 == 0 and packed K % 32 == 0"
        flat = x.view(torch.uint8).reshape(-1, rows * cols)
        out = flat[:, self._weight_order(rows, cols)].reshape(x.shape).view(x.dtype)
        out.is_shuffled = True
        return out

    def unshuffle_weight(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = x.shape[-2:]
        flat = x.view(torch.uint8).reshape(-1, rows * cols)
        out = torch.empty_like(flat)
        out[:, self._weight_order(rows, cols)] = flat
        return out.reshape(x.shape)

    @staticmethod
    @functools.cache
    def _scale_order(rows: int, cols: int) -> torch.Tensor:
        """Source (row, col) flat index of each destination byte of e8m0_shuffle on a [rows, cols]
        buffer already padded to multiples of (32, 8): 32-row x 8-column tiles in row-block then
        column-block order; inside, row r = 16 * r2 + r16 and column c = 4 * c2 + c4 are laid out
        with c4 outermost, then r16, then c2, then r2 innermost."""
        d = torch.arange(rows * cols)
        r2, d = d % 2, d // 2
        c2, d = d % 2, d // 2
        r16, d = d % 16, d // 16
        c4, d = d % 4, d // 4
        cb, rb = d % (cols // 8), d // (cols // 8)
        return (rb * 32 + r2 * 16 + r16) * cols + cb * 8 + c2 * 4 + c4

    def e8m0_shuffle(self, scale):
        self.calls["e8m0_shuffle"] += 1
        assert scale.dim() == 2, "e8m0_shuffle takes a 2-D scale"
        m, n = scale.shape
        rows, cols = -(-m // 256) * 256, -(-n // 8) * 8
        padded = torch.full((rows, cols), 0x7F, dtype=torch.uint8)  # aiter leaves the pad uninitialised
        padded[:m, :n] = scale.view(torch.uint8)
        return padded.flatten()[self._scale_order(rows, cols)].view(rows, cols).view(scale.dtype)

    def unshuffle_scale(self, shuffled: torch.Tensor, m: int, n: int) -> torch.Tensor:
        rows, cols = shuffled.shape
        assert (rows, cols) == (-(-m // 256) * 256, -(-n // 8) * 8), "not the shape e8m0_shuffle gives"
        out = torch.empty(rows * cols, dtype=torch.uint8)
        out[self._scale_order(rows, cols)] = shuffled.view(torch.uint8).flatten()
        return out.view(rows, cols)[:m, :n]

    # ------------------------------------------------------------------ fused MoE

    def fused_moe(self, hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, activation=None,
                  quant_type=None, doweight_stage1=False, w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None):
        self.calls["fused_moe"] += 1
        assert hidden_states.dtype == torch.bfloat16 and hidden_states.dim() == 2
        assert activation == self.silu and quant_type == self.per_1x32 and not doweight_stage1
        assert expert_mask is None and a1_scale is None and a2_scale is None, "dynamic activations, no EP"
        assert w1.dtype == self.fp4x2 and w2.dtype == self.fp4x2, "MXFP4 weights are recognised by dtype fp4x2"
        assert getattr(w1, "is_shuffled", False) and getattr(w2, "is_shuffled", False), \
            "preshuffled weights must say so (is_shuffled), or aiter picks kernels for the raw layout"
        num_experts, _, packed_hidden = w1.shape
        # aiter's get_inter_dim: model_dim = w2.shape[1]; inter_dim = w2.shape[2] * (model_dim // w1.shape[2])
        hidden, inter = w2.shape[1], w2.shape[2] * (w2.shape[1] // packed_hidden)
        assert hidden_states.shape[1] == hidden and w1.shape[1] == 2 * inter, "g1u1: w1 holds gate rows then up rows"
        assert topk_ids.dtype == torch.int32 and topk_weight.dtype == torch.float32
        assert topk_ids.shape == topk_weight.shape and topk_ids.shape[0] == hidden_states.shape[0]
        assert w1_scale.dtype == torch.uint8 and w2_scale.dtype == torch.uint8 and w1_scale.dim() == 2
        w13 = self.unshuffle_weight(w1)
        w2_raw = self.unshuffle_weight(w2)
        s13 = self.unshuffle_scale(w1_scale, num_experts * 2 * inter, hidden // 32).view(num_experts, 2 * inter, -1)
        s2 = self.unshuffle_scale(w2_scale, num_experts * hidden, inter // 32).view(num_experts, hidden, -1)

        # per_1x32 with fp4x2 weights, SiLU, gate/up separated: activations quantized to MXFP4 for both
        # stages (q_dtype_a = fp4x2). The emulation quantizes with Quark's "even" scale rule; aiter's
        # quantizer picks its own scale rounding (docs/rocm.md).
        x = qdq_mxfp4(hidden_states.float())
        out = torch.zeros(hidden_states.shape[0], hidden, dtype=torch.float32)
        for e in torch.unique(topk_ids).tolist():  # each (token, slot) routed to expert e
            token, slot = (topk_ids == e).nonzero(as_tuple=True)
            gate, up = (x[token] @ dequantize_mxfp4(w13[e], s13[e]).T).split(inter, dim=-1)
            h = qdq_mxfp4(torch.nn.functional.silu(gate) * up)
            out.index_add_(0, token, topk_weight[token, slot, None] * (h @ dequantize_mxfp4(w2_raw[e], s2[e]).T))
        return out.to(hidden_states.dtype)
