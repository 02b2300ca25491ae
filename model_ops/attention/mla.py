"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2.x) over a paged latent cache.

Per token the cache keeps one row [kv_a_layernorm(c_kv) (L) | rope(k_pe) (R)] shared by all
heads (576 values for Kimi, independent of the 64 heads). `kv_b_proj` ([N * (P + V), L]) holds,
per head, W_UK (P rows) then W_UV (V rows). Two exact ways to attend:

* absorbed (decode / verify): q_latent = q_nope . W_UK per head, MQA of [q_latent | q_pe] over
  whole rows with values = their first L columns, then W_UV on the [T, N, L] output. Each
  cached row is read once for all heads and never expanded: this is what decode kernels
  (Triton MLA, FlashMLA, aiter) implement, and the backend runs it.
* expanded (prefill): the context rows go through kv_b_proj into per-head k_nope / v, keys are
  [k_nope | shared rope part], attention has qk dim P + R and v dim V. A (query, key) pair costs
  P + R + V multiply-adds per head (320 for Kimi) instead of 2 L + R (1088), so long query runs
  are cheaper this way even after paying (P + V) L per head to expand each context row.

With an fp8 cache, the expanded form attends the step's own rows at model precision (see `attend`).

The form is chosen per step from `max_query_len` (host-side, so no sync): see ABSORBED_MAX_QUERY_LEN.
"""
from __future__ import annotations

import torch

from model_ops import tp
from model_ops.attention.backends import AttentionKind, MLABackend
from model_ops.attention.layer import CachedAttention, Rope
from model_ops.attention.metadata import AttentionMetadata
from model_ops.layernorm import RMSNorm
from model_ops.linear import ColumnParallelLinear, dense_per_head, per_head_gemv

# Steps whose longest query run is at most this take the absorbed form: decode (1 row) and
# speculative verification (k + 1 rows) always do, so those steps never expand the context and
# run through the same backend call a captured graph replays. By FLOP count the absorbed form
# stays cheaper up to (P + V) L / (2 L - P - V) ~ 171 query rows per sequence for Kimi's dims;
# 16 leaves room for up to 15 draft tokens while keeping prompt chunks (usually far longer, and
# where a prefill kernel batches best) on the expanded form.
ABSORBED_MAX_QUERY_LEN = 16


class MLAAttention(CachedAttention):
    """The cached core of an MLA layer: owns kv_b_proj; subclasses add the projections and RoPE.
    `num_heads` is the model's; the layer keeps this tensor-parallel rank's share of them."""

    kind: AttentionKind = "mla"
    num_kv_scales = 1

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float):
        super().__init__()
        # this rank's heads under tensor parallelism (kv_b_proj holds their rows); the latent
        # cache row is per token, not per head, so every rank keeps it whole
        self.num_heads, self.kv_lora_rank = tp.divide(num_heads, "num_attention_heads"), kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale = scale
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim),
                                              what="kv_b_proj rows (num_attention_heads x (qk_nope_head_dim + v_head_dim))")
        # W_UK per head transposed ([N, L, P], P contiguous), made after loading where the absorbed
        # products run the GEMV kernel, which reads weight rows along the summed dim; None: W_UK's view
        # (a buffer, so it moves with the module; not in the state dict)
        self.register_buffer("w_uk_t", None, persistent=False)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.kv_lora_rank + self.qk_rope_head_dim)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [N, P, L] and W_UV [N, V, L]: views of kv_b_proj, no copies."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    # ProcessedAfterLoading (atom_like.loader.weights)
    def process_weights_after_loading(self) -> None:
        """On the GEMV kernel's devices, a K-major copy of W_UK: q_nope . W_UK per head sums over
        W_UK's rows (P), but the kernel's loads run along its weight rows, so it takes W_UK^T
        [N, L, P]. It costs N x L x P x 2 bytes a layer: 1 MiB at Kimi-K2.5 TP8 (8 heads; 61 MiB
        for 61 layers); none at TP1, whose 64 heads keep bmm (per_head_gemv). The alternative, a
        K-major kernel variant, would need q_nope (contiguous along P) and the weight tile
        (contiguous along L) in different register layouts: a shuffle through shared memory every
        K step for a ~1 MiB read."""
        w_uk, _ = self._w_uk_uv()
        self.w_uk_t = w_uk.transpose(1, 2).contiguous() if per_head_gemv(w_uk) else None

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [..., L] -> (k_nope [..., N, P], v [..., N, V])."""
        kv = self.kv_b_proj(latent).view(*latent.shape[:-1], self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        return kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
               meta: AttentionMetadata, absorbed: bool | None = None, rope: Rope | None = None,
               latent_norm: RMSNorm | None = None) -> torch.Tensor:
        """q_nope [T, N, P], q_pe [T, N, R] (after RoPE), this step's latent [T, L] (after
        kv_a_layernorm) and k_pe [T, R] (after RoPE) -> attention output [T, N * V]. With `rope`,
        q_pe and k_pe are not rotated yet: the backend rotates them as it writes the cache. With
        `latent_norm` (kv_a_layernorm), the latent is not normalized yet: the backend normalizes
        it as it writes (the cached rows are all that read it).

        With an fp8 cache the two forms read different values: the expanded form (prefill) attends
        this step's own rows unquantized and only earlier context (prefix-cache hits, earlier
        chunks) through fp8; the absorbed form (decode / verify) reads every row, its own
        included, from the cache, as vLLM's decode does. The form is per step, so a decode row
        batched with a prefill chunk sees its own row unquantized (vLLM splits such a batch).

        `absorbed` forces a form (tests compare the two); None picks it from the query length."""
        cache, backend = self._bound()
        if not isinstance(backend, MLABackend):
            raise TypeError(f"MLA layer bound to {type(backend).__name__}, which is not an MLABackend")
        if absorbed is None:
            absorbed = meta.max_query_len <= ABSORBED_MAX_QUERY_LEN
        # An fp8 cache in the expanded form: the step's own rows are attended at model precision and
        # only earlier context is read back through fp8, as vLLM's (_forward_prefill) and SGLang's MLA
        # prefill do. The write hands back the rows it made (normalized, rotated) before rounding them,
        # so they are bit for bit what a float cache written by the same backend would hold.
        fresh = None if absorbed or self.kv_scales is None else latent.new_empty(latent.shape[0], cache.shape[-1])
        if rope is None:
            backend.write(cache, (latent, k_pe), meta.slot_mapping, self.kv_scales, latent_norm, fresh)
        else:
            q_pe = backend.write_rotated(cache, q_pe, (latent, k_pe), *rope, meta.slot_mapping, self.kv_scales,
                                         latent_norm, fresh)
        if absorbed:
            w_uk, w_uv = self._w_uk_uv()
            w_uk_t = w_uk.transpose(1, 2) if self.w_uk_t is None else self.w_uk_t
            q_latent = dense_per_head(q_nope, w_uk_t)  # [T, N, L]
            out_latent = backend.attend_absorbed(q_latent, q_pe, cache, meta, self.scale, self.kv_scales)
            out = dense_per_head(out_latent, w_uv)  # [T, N, V]
        else:
            out = backend.attend_expanded(q_nope, q_pe, cache, meta, self.scale, self.expand, self.kv_scales, fresh)
        return out.flatten(1)
