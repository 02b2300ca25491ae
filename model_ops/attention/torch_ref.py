"""Pure-PyTorch paged attention: runs on every device and is the oracle for every kernel.

Deliberately simple: gather each sequence's cache rows into a padded batch, then one masked
softmax in fp32. To keep memory bounded for long prompts and mixed prefill/decode batches, the
batch is cut into groups whose padded score tensor stays under a budget; a long prompt is cut
into query chunks, each of which is itself a valid "sequence" (fewer rows, shorter context).
The grouping reads metadata on the host, so this path is never captured in a CUDA graph.

FP8 caches (model_ops.quant.fp8): a write stores quantize_fp8(x, scale) in the cache's e4m3
type, a read dequantizes the gathered rows (entry * scale, fp32) before any arithmetic; one fp32
scale per tensor, passed as a 1-element device tensor (None: the cache is not fp8).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from model_ops.attention.metadata import AttentionMetadata
from model_ops.quant.fp8 import FP8_KV_DTYPES, dequantize_fp8, quantize_fp8

# fp32 elements in one group's score tensor (256 MiB); einsum + softmax hold about three of them.
SCORE_BUDGET = 1 << 26


def check_cache_scale(cache: torch.Tensor, scale: torch.Tensor | None, name: str) -> None:
    """An fp8 cache needs its scale and only an fp8 cache takes one (the kernels' contract too)."""
    if cache.dtype in FP8_KV_DTYPES and scale is None:
        raise ValueError(f"{name}: the cache is {cache.dtype} but no scale was given")
    if cache.dtype not in FP8_KV_DTYPES and scale is not None:
        raise ValueError(f"{name} was given but the cache is {cache.dtype}, not fp8")


def write_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor,
                scale: torch.Tensor | None = None) -> None:
    """Store `values[t]` at slot `slot_mapping[t]` of `cache` ([num_blocks, block_size, ...]),
    fp8-quantized with `scale` when the cache is fp8. Rows with slot -1 (padding) are skipped."""
    check_cache_scale(cache, scale, "scale")
    flat = cache.flatten(0, 1)
    keep = slot_mapping >= 0
    rows = values[keep]
    if scale is not None:  # copied as bytes: index_copy_ has no fp8 kernel on every device
        flat, rows = flat.view(torch.uint8), quantize_fp8(rows, scale, flat.dtype).view(torch.uint8)
    flat.index_copy_(0, slot_mapping[keep], rows.to(flat.dtype))


def read_rows(rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as values: dequantized when the cache is fp8 (`scale` given)."""
    return dequantize_fp8(rows, scale, dtype) if scale is not None else rows


def gather_cache(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Rows `0 .. length-1` of every sequence: [B, length, ...] from a [num_blocks, block_size, ...] cache.

    Positions past a sequence's context read whatever block its table pads with; callers mask them.
    """
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    block_ids = block_tables[:, pos // block_size].long()  # int64: ids past 65,535 times strides
    slots = block_ids * block_size + pos % block_size
    return cache.flatten(0, 1)[slots]


def token_rows(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, row within the sequence) of each flat query token."""
    qsl = meta.query_start_loc.long()
    seq_idx = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=qsl.device), qsl[1:] - qsl[:-1], output_size=num_tokens
    )
    return seq_idx, torch.arange(num_tokens, device=qsl.device) - qsl[seq_idx]


@dataclass
class PaddedQueries:
    """A group's flat queries laid out per sequence for padded attention (padded_causal_attention and
    its fused twin, model_ops.attention.backends.sdpa_causal_attention)."""
    seq_idx: torch.Tensor  # [T]: each flat query's sequence
    row: torch.Tensor  # [T]: its row within the sequence
    q: torch.Tensor  # [B, max_query_len, H, D]: the queries, zero where a sequence has fewer rows
    keys: torch.Tensor  # [B, S, Hkv, Dk]: zero past each context
    values: torch.Tensor  # [B, S, Hkv, Dv]: zero past each context
    visible: torch.Tensor  # [B, max_query_len, S]: query row j of sequence b sees keys 0 ..= context_len - q_len + j

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """[B, max_query_len, H, Dv] -> the flat queries' rows [T, H, Dv]."""
        return out[self.seq_idx, self.row]


def pad_queries(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttentionMetadata,
                dtype: torch.dtype) -> PaddedQueries:
    """The padded layout of flat queries q [T, Hq, Dk] (in `dtype`) over padded keys / values."""
    num_tokens = q.shape[0]
    length = keys.shape[1]
    seq_idx, row = token_rows(meta, num_tokens)
    ctx = meta.context_lens.long()
    # rows past a sequence's context hold whatever its table's padding points at: zero them so
    # garbage (even NaN) cannot leak through a zero attention weight (0 x NaN is NaN)
    beyond = (torch.arange(length, device=q.device)[None, :] >= ctx[:, None])[:, :, None, None]
    q_pad = q.new_zeros(keys.shape[0], meta.max_query_len, *q.shape[1:], dtype=dtype)
    q_pad[seq_idx, row] = q.to(dtype)
    q_pos = (ctx - meta.query_lens.long())[:, None] + torch.arange(meta.max_query_len, device=q.device)[None, :]
    visible = torch.arange(length, device=q.device)[None, None, :] <= q_pos[:, :, None]
    return PaddedQueries(seq_idx, row, q_pad, keys.masked_fill(beyond, 0), values.masked_fill(beyond, 0), visible)


def padded_causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of flat queries q [T, Hq, Dk] over padded per-sequence keys [B, S, Hkv, Dk] and
    values [B, S, Hkv, Dv]; query row j of sequence b sees keys 0 ..= context_len - q_len + j.
    Returns [T, Hq, Dv] in q's dtype, computed in fp32."""
    batch, _, num_kv_heads, _ = keys.shape
    group = q.shape[1] // num_kv_heads
    p = pad_queries(q, keys, values, meta, torch.float32)
    q_pad = p.q.view(batch, meta.max_query_len, num_kv_heads, group, -1)
    scores = torch.einsum("bqhgd,bshd->bhgqs", q_pad, p.keys.float()) * scale
    scores = scores.masked_fill(~p.visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgqs,bshd->bqhgd", probs, p.values.float())
    return p.unpad(out.reshape(batch, meta.max_query_len, q.shape[1], -1)).to(q.dtype)


@dataclass
class SegmentGroup:
    rows: torch.Tensor  # flat query rows of this group, in order
    meta: AttentionMetadata  # the group as a batch of its own (slot_mapping unused)
    seqs: torch.Tensor  # the step's sequence each segment is cut from
    from_step: bool  # no segment's sequence has context before this step: every row it attends is the step's


def segment_groups(meta: AttentionMetadata, num_heads: int, budget: int = SCORE_BUDGET) -> Iterator[SegmentGroup]:
    """Cut a batch into groups whose padded scores (segments x max rows x max context x heads)
    fit the budget. A segment is a run of one sequence's query rows; rows j0..j1 of a sequence
    with context c and q_len n form a sequence of n' = j1 - j0 rows and context c - n + j1."""
    device = meta.query_start_loc.device
    qsl = meta.query_start_loc.tolist()
    ctx = meta.context_lens.tolist()
    segments = []  # (seq, first flat row, rows, context, the sequence's context before the step)
    for b, c in enumerate(ctx):
        start, n = qsl[b], qsl[b + 1] - qsl[b]
        chunk = max(1, budget // max(1, c * num_heads))
        for j0 in range(0, n, chunk):
            j1 = min(n, j0 + chunk)
            segments.append((b, start + j0, j1 - j0, c - n + j1, c - n))

    group: list[tuple[int, int, int, int]] = []
    max_rows = max_ctx = 0
    for seg in segments + [None]:
        if seg is not None:
            rows, c = max(max_rows, seg[2]), max(max_ctx, seg[3])
            if not group or (len(group) + 1) * rows * c * num_heads <= budget:
                group.append(seg)
                max_rows, max_ctx = rows, c
                continue
        yield _make_group(group, meta, max_rows, max_ctx, device)
        group, max_rows, max_ctx = ([seg], seg[2], seg[3]) if seg is not None else ([], 0, 0)


def _make_group(group, meta: AttentionMetadata, max_rows: int, max_ctx: int, device) -> SegmentGroup:
    seqs = torch.tensor([s[0] for s in group], device=device)
    rows = torch.cat([torch.arange(s[1], s[1] + s[2], device=device) for s in group])
    lens = torch.tensor([0] + [s[2] for s in group], device=device, dtype=torch.int32)
    sub = AttentionMetadata(
        query_start_loc=lens.cumsum(0, dtype=torch.int32),
        context_lens=torch.tensor([s[3] for s in group], device=device, dtype=torch.int32),
        block_tables=meta.block_tables[seqs],
        slot_mapping=meta.slot_mapping[rows],
        max_query_len=max_rows,
        max_context_len=max_ctx,
    )
    return SegmentGroup(rows, sub, seqs, from_step=all(s[4] == 0 for s in group))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged attention over caches [num_blocks, block_size, Hkv, D]; see AttentionMetadata.
    `k_scale` / `v_scale`: the fp8 caches' scales (None: not fp8).

    MLA's absorbed decode is the same call with one KV head: k_cache = latent rows [.., 1, L+R],
    v_cache = the first L columns of the same rows (one scale for both).
    """
    check_cache_scale(k_cache, k_scale, "k_scale")
    check_cache_scale(v_cache, v_scale, "v_scale")
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    for g in segment_groups(meta, q.shape[1]):
        keys = gather_cache(k_cache, g.meta.block_tables, g.meta.max_context_len)
        values = gather_cache(v_cache, g.meta.block_tables, g.meta.max_context_len)
        keys, values = read_rows(keys, k_scale, torch.float32), read_rows(values, v_scale, torch.float32)
        out[g.rows] = padded_causal_attention(q[g.rows], keys, values, g.meta, scale)
    return out


# latent rows [..., L] -> (k_nope [..., N, P], v [..., N, V]) through the layer's kv_b_proj
LatentExpander = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def mla_absorbed_attention(
    q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA in the absorbed form: q_latent [T, N, L] (q_nope . W_UK) and q_pe [T, N, R] attend, as
    one KV head, to whole latent rows [num_blocks, block_size, L + R] with the first L columns as
    values. `kv_scale`: the fp8 cache's one scale for the whole row. Returns [T, N, L]."""
    rows = cache.unsqueeze(2)
    return paged_attention(torch.cat([q_latent, q_pe], dim=-1), rows, rows[..., : q_latent.shape[-1]], meta, scale,
                           kv_scale, kv_scale)


# (flat queries [T, H, Dk], padded keys [B, S, H, Dk], values [B, S, H, Dv], the group's metadata, scale) -> [T, H, Dv]
PaddedAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


def mla_expanded_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    expand: LatentExpander, kv_scale: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None, attention: PaddedAttention | None = None,
) -> torch.Tensor:
    """MLA in the expanded form: each group's context latent rows (dequantized to q's dtype when
    the cache is fp8) go through `expand` to per-head k_nope / v, keys are [k_nope | shared rope
    part], and q = [q_nope | q_pe] attends causally with qk dim P + R and v dim V. Returns [T, N, V].

    `fresh` [T, L + R]: this step's rows as written (normalized, rotated), at model precision
    (the write's `rows_out`); they replace, in each sequence's context, the cached rows of the step's own
    tokens, so only earlier context (prefix-cache hits, earlier chunks) is read through the cache.
    MLAAttention passes them for an fp8 cache (vLLM's and SGLang's MLA prefill attend the new
    tokens unquantized); a float cache already holds these values.

    `attention`: the core over each group's padded rows (None: padded_causal_attention, fp32 scores
    under SCORE_BUDGET); one that keeps no score tensor (a fused kernel) is grouped by its [B, Q, S]
    mask alone, i.e. as if one head."""
    check_cache_scale(cache, kv_scale, "kv_scale")
    num_heads, rope_dim = q_pe.shape[1], q_pe.shape[2]
    latent_dim = cache.shape[-1] - rope_dim
    q = torch.cat([q_nope, q_pe], dim=-1)
    step_rows = None if fresh is None else fresh.to(q.dtype)
    out: torch.Tensor | None = None
    core = attention or padded_causal_attention
    for g in segment_groups(meta, num_heads if attention is None else 1):
        if step_rows is not None and g.from_step:
            # prompts with no earlier context (no prefix hit, a first chunk): nothing to read back,
            # the group's rows are all the step's (positions past a context take a clamped row, masked)
            rows = step_rows[step_row_index(g.meta.max_context_len, g, meta, step_rows.shape[0])[1]]
        else:
            rows = read_rows(gather_cache(cache, g.meta.block_tables, g.meta.max_context_len), kv_scale, q.dtype)
            if step_rows is not None:
                overlay_step_rows(rows, step_rows, g, meta)
        k_nope, values = expand(rows[..., :latent_dim])
        k_pe = rows[..., None, latent_dim:].expand(-1, -1, num_heads, -1)
        keys = torch.cat([k_nope, k_pe.to(k_nope.dtype)], dim=-1)
        group_out = core(q[g.rows], keys, values, g.meta, scale)
        if out is None:
            out = q.new_empty(q.shape[0], num_heads, group_out.shape[-1])
        out[g.rows] = group_out
    assert out is not None, "an attention step has at least one query row"
    return out


def step_row_index(length: int, group: SegmentGroup, meta: AttentionMetadata,
                   num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For positions 0 ..< length of each of a group's segments: (own [G, length], whether the position
    holds one of the step's own tokens; src [G, length], that token's flat row among the step's
    `num_tokens`, clamped into range where it does not). Segment g, cut from sequence b, sees the step's tokens at positions
    context_lens[b] - q_len[b] ..< its own context length; the token at position p is the step's flat
    row query_start_loc[b] + p - (context_lens[b] - q_len[b])."""
    first = (meta.context_lens - meta.query_lens).long()[group.seqs]  # the step's first position, per segment
    pos = torch.arange(length, device=first.device)[None, :]
    own = (pos >= first[:, None]) & (pos < group.meta.context_lens.long()[:, None])
    src = (meta.query_start_loc.long()[group.seqs][:, None] + pos - first[:, None]).clamp(0, num_tokens - 1)
    return own, src


def overlay_step_rows(rows: torch.Tensor, step_rows: torch.Tensor, group: SegmentGroup,
                      meta: AttentionMetadata) -> None:
    """Overwrite, in a group's gathered context rows [G, S, D], the positions of the step's own
    tokens with their `step_rows` [T, D] (flat, as the step's queries; see step_row_index)."""
    own, src = step_row_index(rows.shape[1], group, meta, step_rows.shape[0])
    # a select, not a boolean-mask assignment (that one reads the mask's count back to the host);
    # rows is a gathered copy, never the cache
    rows.copy_(torch.where(own[..., None], step_rows[src], rows))
