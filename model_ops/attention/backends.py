"""Attention backends and the one place that picks a backend for a layer.

A backend is the pair (KV write, paged attention) for one cache layout. The torch reference runs
everywhere and is the oracle; faster backends (Triton on any GPU) are listed here and chosen by
`select_backend` alone, so model code never changes when a backend is added. aiter (ROCm,
gfx942/gfx950, kernels_rocm.aiter_ops) serves MLA decode / verify only and never ran on AMD
hardware (docs/rocm.md); asking for it where it cannot run is refused at start-up, with why.

MHA backends implement `MHABackend.attend`; MLA backends implement `MLABackend`, whose
absorbed call has exactly the signature of the Triton kernel `kernels_rocm.mla_decode.
mla_paged_attention` (q_latent, q_pe, latent cache, metadata, scale -> [T, N, L]), so a kernel
is a few-line subclass and the MLA layer never changes.

Rotary embedding can ride along with the write (`write_rotated`): the reference rotates eagerly
(model_ops.rotary) and writes; the Triton backends rotate q and k inside the cache-write kernel
(kernels_rocm.rope_kv_cache), one launch instead of ~15 a layer.

`scales` are a layer's fp8 KV-cache scales, 1-element fp32 device tensors: (k_scale, v_scale)
for MHA, (scale,) for MLA's latent rows; None when the cache is not fp8 (MXFP4_CONTRACT.md).
MHA reads every row through the cache, the step's own included (vLLM's FlashAttention backend
does too); MLA's expanded (prefill) form takes the step's own rows unquantized (`fresh`, see
MLAAttention.attend), its absorbed form reads them from the cache.
"""
from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from typing import Literal

import torch
import torch.nn.functional as F

from kernels_rocm.aiter_ops import (
    AiterOps,
    MLADecodeMetadata,
    Platform,
    aiter_unavailable_reason,
    detect_platform,
    import_aiter,
    mla_decode,
    mla_decode_metadata,
    mla_takes,
)
from model_ops.attention import torch_ref
from model_ops.attention.metadata import AttentionMetadata
from model_ops.layernorm import RMSNorm
from model_ops.rotary import RotaryEmbedding

CosSin = tuple[torch.Tensor, torch.Tensor]

AttentionKind = Literal["mha", "mla"]
Role = Literal["target", "draft"]
KVScales = tuple[torch.Tensor, ...] | None
MLARows = tuple[torch.Tensor, torch.Tensor]  # (latent [T, L], k_pe [T, R]) of an MLA step
BACKEND_CHOICES = ("auto", "torch", "triton", "aiter")


def check_backend_choice(preference: str, flag: str = "--attention-backend") -> None:
    """`preference` is a backend name this engine knows, else a ValueError naming `flag`."""
    if preference not in BACKEND_CHOICES:
        raise ValueError(f"{flag} must be one of {', '.join(BACKEND_CHOICES)}; got {preference!r}")


def check_aiter_available(flag: str, platform: Platform) -> None:
    """An explicit request for aiter fails at start-up, saying why, where aiter cannot run."""
    reason = aiter_unavailable_reason(platform)
    if reason is not None:
        raise ValueError(f"{flag} aiter is not available: {reason}; use auto, torch or triton "
                         "(Triton kernels compile for ROCm too)")


class AttentionBackend(ABC):
    """Writes a layer's new KV rows into its paged cache; the kind-specific subclasses attend.

    `cache` is one layer's view of the pool, shaped by the layer's `kv_cache_shape`.
    """

    name: str
    # whether a CUDA/HIP graph can capture its calls; the torch reference cannot (its writes and
    # attention read the step's metadata back to the host: boolean masks, per-sequence loops)
    capturable: bool = True

    @abstractmethod
    def write(self, cache: torch.Tensor, rows: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor,
              scales: KVScales = None) -> None: ...


def _kv(scales: KVScales) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return scales if scales is not None else (None, None)


def _kernel_scales(scales: KVScales, *names: str) -> dict[str, torch.Tensor]:
    """Keyword arguments for a kernel: its scale arguments, only for an fp8 cache."""
    return dict(zip(names, scales)) if scales is not None else {}


class MHABackend(AttentionBackend):
    def write_rotated(self, cache: torch.Tensor, q: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor],
                      rotary: RotaryEmbedding, cos_sin: CosSin, slot_mapping: torch.Tensor,
                      scales: KVScales = None) -> torch.Tensor:
        """Rotate q [T, Hq, D] and the key of rows = (key, value), write (rope(key), value);
        return rope(q). The eager reference; kernels override it."""
        key, value = rows
        q, key = rotary.apply(q, *cos_sin), rotary.apply(key, *cos_sin)
        self.write(cache, (key, value), slot_mapping, scales)
        return q

    @abstractmethod
    def attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               scales: KVScales = None) -> torch.Tensor: ...


class TorchMHABackend(MHABackend):
    """MHA/GQA cache [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V)."""

    name = "torch"
    capturable = False

    def write(self, cache, rows, slot_mapping, scales=None):
        key, value = rows
        k_scale, v_scale = _kv(scales)
        torch_ref.write_cache(cache[0], key, slot_mapping, k_scale)
        torch_ref.write_cache(cache[1], value, slot_mapping, v_scale)

    def attend(self, q, cache, meta, scale, scales=None):
        return torch_ref.paged_attention(q, cache[0], cache[1], meta, scale, *_kv(scales))


class TritonMHABackend(MHABackend):
    """kernels_rocm's paged MHA/GQA kernels: int64 addressing (block ids past 65,535), graph-capturable."""

    name = "triton"

    def write(self, cache, rows, slot_mapping, scales=None):
        from kernels_rocm.kv_cache import write_kv_cache

        key, value = rows
        write_kv_cache(key, value, cache[0], cache[1], slot_mapping, **_kernel_scales(scales, "k_scale", "v_scale"))

    def write_rotated(self, cache, q, rows, rotary, cos_sin, slot_mapping, scales=None):
        from kernels_rocm.rope_kv_cache import rope_write_kv_cache

        key, value = rows
        return rope_write_kv_cache(q, key, value, cache[0], cache[1], *cos_sin, slot_mapping, rotary.interleaved,
                                   **_kernel_scales(scales, "k_scale", "v_scale"))

    def attend(self, q, cache, meta, scale, scales=None):
        from kernels_rocm.paged_attention import paged_attention

        return paged_attention(q, cache[0], cache[1], meta.query_start_loc, meta.context_lens, meta.block_tables,
                               meta.max_query_len, meta.max_context_len, scale,
                               **_kernel_scales(scales, "k_scale", "v_scale"))


class MLABackend(AttentionBackend):
    """MLA latent cache [num_blocks, block_size, L + R]; a row is [kv_a_layernorm(c_kv) | rope(k_pe)].

    `write` takes rows = (latent [T, L], k_pe [T, R]). With `latent_norm` (the layer's
    kv_a_layernorm) the latent is not normalized yet and the backend normalizes it as it writes:
    the Triton kernel in the same launch, the reference by running the module.
    """

    def write(self, cache: torch.Tensor, rows: MLARows, slot_mapping: torch.Tensor,
              scales: KVScales = None, latent_norm: RMSNorm | None = None,
              rows_out: torch.Tensor | None = None) -> None:
        values = torch.cat(mla_row_values(rows, latent_norm), dim=-1)
        torch_ref.write_cache(cache, values, slot_mapping, _latent(scales))
        if rows_out is not None:
            rows_out.copy_(values)

    def write_rotated(self, cache: torch.Tensor, q_pe: torch.Tensor, rows: MLARows,
                      rotary: RotaryEmbedding, cos_sin: CosSin, slot_mapping: torch.Tensor,
                      scales: KVScales = None, latent_norm: RMSNorm | None = None,
                      rows_out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate q_pe [T, N, R] and the k_pe of rows = (latent, k_pe), write [latent | rope(k_pe)]
        (latent through `latent_norm` when given); return rope(q_pe). The eager reference; kernels
        override it.

        `rows_out` [T, L + R] (both writes), when given, receives the rows written before any fp8
        rounding, as the backend made them: the `fresh` rows of an fp8 prefill (attend_expanded),
        equal bit for bit to what a float cache written by the same backend holds."""
        self.write(cache, mla_row_values(rows, rope=(rotary, cos_sin)), slot_mapping, scales, latent_norm, rows_out)
        return rotary.apply(q_pe, *cos_sin)

    @abstractmethod
    def attend_absorbed(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, scales: KVScales = None) -> torch.Tensor:
        """q_latent [T, N, L] (q_nope . W_UK), q_pe [T, N, R] after RoPE -> [T, N, L] (before W_UV):
        MQA over whole latent rows, values = their first L columns, causal as in AttentionMetadata."""

    def attend_expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, expand: torch_ref.LatentExpander,
                        scales: KVScales = None, fresh: torch.Tensor | None = None) -> torch.Tensor:
        """q_nope [T, N, P], q_pe [T, N, R] -> [T, N, V], context rows expanded through `expand`
        (kv_b_proj). `fresh` [T, L + R]: this step's rows at model precision (the write's `rows_out`), attended in
        place of their cached copies (torch_ref.mla_expanded_attention). Backends without a
        prefill kernel inherit the reference."""
        return torch_ref.mla_expanded_attention(q_nope, q_pe, cache, meta, scale, expand, _latent(scales), fresh)


def _latent(scales: KVScales) -> torch.Tensor | None:
    return scales[0] if scales is not None else None


def mla_row_values(rows: MLARows, latent_norm: RMSNorm | None = None,
                   rope: tuple[RotaryEmbedding, CosSin] | None = None) -> MLARows:
    """The values of latent cache rows before any fp8 rounding, from rows = (latent [T, L],
    k_pe [T, R]): the latent through `latent_norm` and k_pe rotated by `rope` (rotary, cos/sin),
    each when given. The eager form of what the Triton write kernels do inside."""
    latent, k_pe = rows
    if latent_norm is not None:
        latent = latent_norm(latent)
    if rope is not None:
        rotary, cos_sin = rope
        k_pe = rotary.apply(k_pe.unsqueeze(1), *cos_sin).squeeze(1)
    return latent, k_pe


class TorchMLABackend(MLABackend):
    name = "torch"
    capturable = False

    def attend_absorbed(self, q_latent, q_pe, cache, meta, scale, scales=None):
        return torch_ref.mla_absorbed_attention(q_latent, q_pe, cache, meta, scale, _latent(scales))


def sdpa_causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttentionMetadata,
                          scale: float) -> torch.Tensor:
    """torch_ref.padded_causal_attention's contract (one KV head per query head here) through
    torch.nn.functional.scaled_dot_product_attention in q's dtype: a fused kernel on a GPU (the
    memory-efficient one takes the mask and a value width other than the key's), no fp32 score
    tensor. Why: MLA prefill's expanded form on the reference ran fp32 einsums, 3.3 ms of GPU time a
    layer at 4,096 tokens on an H100 for Kimi's TP8 rank shape (docs/benchmarks.md section 6)."""
    p = torch_ref.pad_queries(q, keys, values, meta, q.dtype)
    out = F.scaled_dot_product_attention(p.q.transpose(1, 2), p.keys.transpose(1, 2).to(q.dtype),
                                         p.values.transpose(1, 2).to(q.dtype), attn_mask=p.visible[:, None],
                                         scale=scale)
    return p.unpad(out.transpose(1, 2))


class TritonMLABackend(MLABackend):
    """kernels_rocm's MLA kernels (any GPU); registered, like the MHA ones, where triton is importable.
    Prefill (the expanded form) has no Triton kernel: the reference's gathers and expansion, then
    scaled_dot_product_attention (sdpa_causal_attention)."""

    name = "triton"

    def write(self, cache, rows, slot_mapping, scales=None, latent_norm=None, rows_out=None):
        from kernels_rocm.kv_cache import write_mla_kv_cache

        # the models write through write_rotated; this unrotated write keeps the norm a launch of its own
        latent = rows[0] if latent_norm is None else latent_norm(rows[0])
        write_mla_kv_cache(latent, rows[1], cache, slot_mapping, **_kernel_scales(scales, "scale"))
        if rows_out is not None:
            torch.cat([latent, rows[1]], dim=-1, out=rows_out)

    def write_rotated(self, cache, q_pe, rows, rotary, cos_sin, slot_mapping, scales=None, latent_norm=None,
                      rows_out=None):
        from kernels_rocm.rope_kv_cache import rope_write_mla_kv_cache

        norm = {} if latent_norm is None else dict(norm_weight=latent_norm.weight, norm_eps=latent_norm.eps)
        return rope_write_mla_kv_cache(q_pe, rows[0], rows[1], cache, *cos_sin, slot_mapping, rotary.interleaved,
                                       **_kernel_scales(scales, "scale"), **norm, rows_out=rows_out)

    def attend_expanded(self, q_nope, q_pe, cache, meta, scale, expand, scales=None, fresh=None):
        return torch_ref.mla_expanded_attention(q_nope, q_pe, cache, meta, scale, expand, _latent(scales), fresh,
                                                attention=sdpa_causal_attention)

    def attend_absorbed(self, q_latent, q_pe, cache, meta, scale, scales=None):
        from kernels_rocm.mla_decode import mla_paged_attention

        return mla_paged_attention(q_latent, q_pe, cache, meta.query_start_loc, meta.context_lens, meta.block_tables,
                                   meta.max_query_len, meta.max_context_len, scale,
                                   **_kernel_scales(scales, "kv_scale"))


class AiterMLABackend(MLABackend):
    """aiter's MLA decode kernels (kernels_rocm.aiter_ops) for absorbed steps whose every sequence
    has 1, 2 or 4 query rows (decode, and verify with up to 3 draft tokens); every other absorbed
    step (3 rows, mixed batches), the KV writes (rope fused or not) and the expanded (prefill) form
    run `fallback` (Triton). Never executed on AMD hardware (docs/rocm.md)."""

    name = "aiter"

    def __init__(self, ops: AiterOps | None = None, fallback: MLABackend | None = None):
        self.ops = ops if ops is not None else import_aiter()
        self.fallback = fallback if fallback is not None else TritonMLABackend()
        self._step: tuple[AttentionMetadata, MLADecodeMetadata] | None = None

    def write(self, cache, rows, slot_mapping, scales=None, latent_norm=None, rows_out=None):
        self.fallback.write(cache, rows, slot_mapping, scales, latent_norm, rows_out)

    def write_rotated(self, cache, q_pe, rows, rotary, cos_sin, slot_mapping, scales=None, latent_norm=None,
                      rows_out=None):
        return self.fallback.write_rotated(cache, q_pe, rows, rotary, cos_sin, slot_mapping, scales, latent_norm,
                                           rows_out)

    def attend_expanded(self, q_nope, q_pe, cache, meta, scale, expand, scales=None, fresh=None):
        return self.fallback.attend_expanded(q_nope, q_pe, cache, meta, scale, expand, scales, fresh)

    def attend_absorbed(self, q_latent, q_pe, cache, meta, scale, scales=None):
        if not mla_takes(q_latent.dtype, q_latent.shape[0], meta.num_seqs, meta.max_query_len):
            return self.fallback.attend_absorbed(q_latent, q_pe, cache, meta, scale, scales)
        return mla_decode(self.ops, q_latent, q_pe, cache, self._metadata(meta, cache), scale, _latent(scales))

    def _metadata(self, meta: AttentionMetadata, cache: torch.Tensor) -> MLADecodeMetadata:
        """aiter's form of the step, built once per step: every layer of a step (and of a captured
        graph) is handed the same AttentionMetadata object, and each step a new one."""
        if self._step is None or self._step[0] is not meta:
            slots = cache.shape[0] * cache.shape[1]
            if slots >= 2**31:
                raise ValueError(f"the KV pool has {slots} token slots; aiter's kv_indices are int32 (< 2^31 slots)")
            self._step = (meta, mla_decode_metadata(meta.query_start_loc, meta.context_lens, meta.block_tables,
                                                    cache.shape[1], meta.max_query_len))
        return self._step[1]


_BACKENDS: dict[tuple[AttentionKind, str], type[AttentionBackend]] = {
    ("mha", "torch"): TorchMHABackend,
    ("mla", "torch"): TorchMLABackend,
}
if importlib.util.find_spec("triton") is not None:  # Linux wheels; without it only the reference runs
    _BACKENDS[("mha", "triton")] = TritonMHABackend
    _BACKENDS[("mla", "triton")] = TritonMLABackend


def choose_backend(kind: AttentionKind, role: Role, preference: str, platform: Platform) -> str:
    """The backend name for a layer of `kind` serving `role` on `platform` (see select_backend)."""
    check_backend_choice(preference)
    registered = sorted(n for k, n in _BACKENDS if k == kind)
    if preference == "aiter":
        check_aiter_available("--attention-backend", platform)
        if kind == "mla":
            return "aiter"
        if role == "draft":  # seed 004: a pure-MHA draft stays on Triton whatever the target uses
            return "triton"
        raise ValueError("--attention-backend aiter serves MLA layers only (aiter's paged MHA kernels are not "
                         "wired here); this model's attention is MHA: use auto or triton")
    if preference == "auto":
        if platform.device_type == "cpu":
            return "torch"
        if kind == "mla" and aiter_unavailable_reason(platform) is None:
            return "aiter"
        return "triton" if "triton" in registered else "torch"
    if preference not in registered:
        raise ValueError(f"no {preference} attention backend for {kind} layers here (available: {', '.join(registered)})")
    return preference


def select_backend(kind: AttentionKind, device: torch.device, role: Role, preference: str = "auto") -> AttentionBackend:
    """The backend for a layer of `kind` serving `role` on `device`: `preference` if not "auto",
    else the torch reference on CPU, and on a GPU aiter for MLA layers where aiter runs (ROCm
    gfx942/gfx950 with aiter importable), Triton otherwise. Pure-MHA draft layers never take
    aiter's paged attention: its assembly kernels read block `id & 0xFFFF` once a draft pool
    passes 65,535 blocks (ROCm/ATOM#702, ROCm/aiter#3062; ROCm/ATOM#631 routes them to Triton)."""
    name = choose_backend(kind, role, preference, detect_platform(device))
    if name == "aiter":
        return AiterMLABackend()
    return _BACKENDS[(kind, name)]()
