"""aiter (ROCm) bindings: the only module that calls aiter. NEVER EXECUTED ON AMD HARDWARE.

Everything here was written from aiter's source and checked on CPU against a torch emulation of
the two entry points (tests/aiter_emulation.py); no AMD GPU was available. Read at ROCm/aiter
e4048607 (main, 2026-08-22) and amd-aiter 0.1.7.post2.dev18 (PyPI), with ROCm/ATOM ffdf3bb5 for
how ATOM calls them. See docs/rocm.md for what is emulated and what is not.

Two adapters, each taking the aiter entry points as a constructor argument (`AiterOps`, default:
the real `import aiter`), so tests inject an emulation and production code has no test hooks:

* `mla_decode`: absorbed MLA decode / verify through `aiter.mla.mla_decode_fwd` in its
  non-persistent mode (no `get_mla_metadata_v1` work plan). Page size 1 with token-level
  `kv_indices`, as ATOM (ATOM_MLA_PAGE_SIZE=1) and vLLM's aiter backend run it: the gfx942/gfx950
  decode kernels address single-token pages; larger pages are gfx1250 work.
* `AiterMXFP4MoE`: Quark MXFP4 routed experts through `aiter.fused_moe.fused_moe` with
  QuantType.per_1x32, weights shuffled once at load with `shuffle_weight(layout=(16, 16))` and
  scales with `e8m0_shuffle`, as ATOM's Mxfp4MoEMethod does on gfx950 (gate/up separated).

Imports only torch (and aiter, lazily).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

AITER_ARCHS = ("gfx942", "gfx950")  # MI300X/MI325X, MI350X/MI355X
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


class AiterOps(Protocol):
    """The aiter entry points atom_like calls, with aiter's own argument names and meanings."""

    fp4x2: torch.dtype  # aiter.dtypes.fp4x2: the dtype fused_moe recognises packed MXFP4 weights by
    per_1x32: Any  # aiter.QuantType.per_1x32: one E8M0 scale per 32 inputs (MXFP4 / MXFP8)
    silu: Any  # aiter.ActivationType.Silu: act(gate) * up on [gate rows | up rows] of w1

    # aiter.mla.mla_decode_fwd; called with the 8 positional arguments and keywords both the
    # PyPI 0.1.7 and main signatures take (main inserted page_size / nhead_kv before sm_scale)
    mla_decode_fwd: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    fused_moe: Callable[..., torch.Tensor]  # aiter.fused_moe.fused_moe
    shuffle_weight: Callable[..., torch.Tensor]  # aiter.ops.shuffle.shuffle_weight
    e8m0_shuffle: Callable[[torch.Tensor], torch.Tensor]  # aiter.utility.fp4_utils.e8m0_shuffle


class ImportedAiter:
    """`AiterOps` from the installed aiter package (raises whatever `import aiter` raises)."""

    def __init__(self) -> None:
        import aiter
        from aiter.fused_moe import fused_moe
        from aiter.mla import mla_decode_fwd
        from aiter.ops.shuffle import shuffle_weight
        from aiter.utility.fp4_utils import e8m0_shuffle

        self.fp4x2 = aiter.dtypes.fp4x2
        self.per_1x32 = aiter.QuantType.per_1x32
        self.silu = aiter.ActivationType.Silu
        self.mla_decode_fwd, self.fused_moe = mla_decode_fwd, fused_moe
        self.shuffle_weight, self.e8m0_shuffle = shuffle_weight, e8m0_shuffle


@functools.cache
def import_aiter() -> AiterOps:
    return ImportedAiter()


# ----------------------------------------------------------------------------- platform


@dataclass(frozen=True)
class Platform:
    """What decides whether aiter can run: the device, the torch build, the GPU, the package."""

    device_type: str  # "cpu" | "cuda" (ROCm GPUs are "cuda" in torch)
    rocm: bool  # torch is a ROCm (HIP) build
    arch: str | None  # the GPU's gfx name without feature flags ("gfx942"), None off ROCm
    aiter_import_error: str | None  # why `import aiter` failed; None: it worked, or was not tried


@functools.cache
def _aiter_import_error() -> str | None:
    try:
        import_aiter()
    except Exception as e:  # ImportError, or aiter's own RuntimeError/OSError without ROCm
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


def detect_platform(device: torch.device) -> Platform:
    """This process's platform for `device`; tries `import aiter` only on a gfx942/gfx950 GPU."""
    if device.type != "cuda":
        return Platform(device.type, False, None, None)
    if torch.version.hip is None:
        return Platform("cuda", False, None, None)
    arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
    return Platform("cuda", True, arch, _aiter_import_error() if arch in AITER_ARCHS else None)


def aiter_unavailable_reason(platform: Platform) -> str | None:
    """Why aiter cannot run on `platform`, in words for an error message; None when it can."""
    where = "aiter's kernels run on AMD Instinct GPUs under ROCm (gfx942: MI300X/MI325X, gfx950: MI350X/MI355X)"
    if platform.device_type != "cuda":
        return f"the device is the {platform.device_type.upper()}; {where}"
    if not platform.rocm:
        return f"this torch is a CUDA build (an NVIDIA GPU); {where}"
    if platform.arch not in AITER_ARCHS:
        return f"the GPU is {platform.arch}; atom_like's aiter adapters are wired for {' and '.join(AITER_ARCHS)} only"
    if platform.aiter_import_error is not None:
        return (f"`import aiter` failed ({platform.aiter_import_error}); install aiter for this ROCm "
                "(pip install amd-aiter, or build github.com/ROCm/aiter)")
    return None


# ----------------------------------------------------------------------------- MLA decode

MLA_QUERY_LENS = (1, 2, 4)  # query rows per sequence with a non-persistent gqa-16 kernel (bf16 and fp8)
MLA_HEAD_GROUP = 16  # heads per call: gqa 16 is the one width every arch/dtype/qlen above has


def mla_takes(q_dtype: torch.dtype, num_tokens: int, num_seqs: int, max_query_len: int) -> bool:
    """Whether aiter's non-persistent MLA decode kernels take a step (host values only, no sync).

    Per hsa/gfx942|gfx950/mla/mla_asm.csv and csrc/py_itfs_cu/asm_mla.cu (e4048607): at gqa 16,
    bf16 queries (bf16 cache) and fp8 queries (fp8 cache) have kernels for 1, 2 and 4 query rows
    (qlen 3 would ride the 4-row kernel, which the fp8 table does not promise). The kernel finds
    sequence b's queries at row b * max_seqlen_q (stride_Q = row stride * max_seqlen_q), so every
    sequence must have exactly max_query_len rows: T == B * max_query_len, which holds for decode
    and for verify steps (k + 1 rows each) but not for mixed or prefill batches."""
    return (q_dtype == torch.bfloat16 and max_query_len in MLA_QUERY_LENS
            and num_tokens == num_seqs * max_query_len)


@dataclass(frozen=True)
class MLADecodeMetadata:
    """One step's metadata in aiter's CSR form, page size 1 (a page is one token slot)."""

    qo_indptr: torch.Tensor  # [B + 1] int32: sequence b's query rows are qo_indptr[b] : qo_indptr[b + 1]
    kv_indptr: torch.Tensor  # [B + 1] int32: prefix sums of the context lengths (in pages = tokens)
    kv_indices: torch.Tensor  # [B * W] int32 slot ids (block * block_size + offset); entries past kv_indptr[B] unused
    kv_last_page_lens: torch.Tensor  # [B] int32: tokens in each sequence's last page (1 at page size 1)
    max_seqlen_q: int


def mla_decode_metadata(query_start_loc: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                        block_size: int, max_query_len: int) -> MLADecodeMetadata:
    """Our block tables / context lengths -> aiter's indptr arrays, on the device, with static shapes
    (a graph replays it): `kv_indices` holds every sequence's slots packed at kv_indptr[b], in a
    buffer of B x (table width x block_size) so no host read of the lengths is needed. Slots are
    int32, as aiter reads them: exact for block ids past 65,535 as long as the pool has fewer than
    2^31 slots, which the caller checks. The B x W temporaries (int32 slots, int64 scatter index)
    are the price of doing this in torch: 12 bytes a table entry, 400 MB at 256 sequences of 128k."""
    num_seqs, width = block_tables.shape
    device = block_tables.device
    ctx = context_lens.to(torch.int32)
    kv_indptr = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(ctx, 0, dtype=torch.int32)
    pos = torch.arange(width * block_size, device=device, dtype=torch.int32)
    slots = block_tables.to(torch.int32)[:, pos // block_size] * block_size + pos % block_size  # [B, W * bs]
    capacity = num_seqs * width * block_size
    # token j of sequence b goes to kv_indptr[b] + j; positions past its context to a dump slot
    dest = torch.where(pos[None, :] < ctx[:, None], kv_indptr[:-1, None].long() + pos[None, :], capacity)
    kv_indices = torch.zeros(capacity + 1, dtype=torch.int32, device=device)
    kv_indices.scatter_(0, dest.flatten(), slots.flatten())
    return MLADecodeMetadata(
        qo_indptr=query_start_loc.to(torch.int32),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices[:capacity],
        kv_last_page_lens=torch.ones(num_seqs, dtype=torch.int32, device=device),
        max_seqlen_q=max_query_len,
    )


def mla_decode(ops: AiterOps, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               md: MLADecodeMetadata, scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA through aiter.mla.mla_decode_fwd: q_latent [T, N, L] and q_pe [T, N, R] (bf16)
    over kv_cache [NB, BS, L + R] -> [T, N, L] in q's dtype. The step must satisfy `mla_takes`.

    q = [q_latent | q_pe] per head, padded with zero heads to a multiple of 16 and run 16 heads a
    call (ATOM pads Kimi's 8 heads per TP8 rank to 16 the same way; at 64 heads that is 4 calls,
    each reading the KV once). An fp8 cache (one fp32 `kv_scale`, entry * scale = value) takes fp8
    queries, as aiter's a8w8 kernels do: q is quantized per tensor with q_scale = amax / fp8 max,
    a device scalar (no sync); aiter multiplies scores by q_scale * kv_scale."""
    num_tokens, num_heads, latent_dim = q_latent.shape
    num_seqs = md.qo_indptr.shape[0] - 1
    if not mla_takes(q_latent.dtype, num_tokens, num_seqs, md.max_seqlen_q):
        raise ValueError(f"aiter MLA decode takes bf16 queries, {' / '.join(map(str, MLA_QUERY_LENS))} rows for every "
                         f"sequence; got {q_latent.dtype}, {num_tokens} rows for {num_seqs} sequences "
                         f"(max {md.max_seqlen_q}): route the step elsewhere (mla_takes)")
    fp8 = kv_cache.dtype in _FP8
    if fp8 != (kv_scale is not None):
        raise ValueError(f"kv_scale must be given exactly when the cache is fp8 (cache {kv_cache.dtype})")
    groups = -(-num_heads // MLA_HEAD_GROUP)
    q = q_latent.new_zeros(num_tokens, groups * MLA_HEAD_GROUP, latent_dim + q_pe.shape[-1])
    q[:, :num_heads, :latent_dim] = q_latent
    q[:, :num_heads, latent_dim:] = q_pe
    q_scale = None
    if fp8:
        limit = float(torch.finfo(kv_cache.dtype).max)
        q_scale = (q.abs().amax().float() / limit).clamp(min=torch.finfo(torch.float32).tiny).reshape(1)
        q = (q.float() / q_scale).clamp(-limit, limit).to(kv_cache.dtype)
    kv_buffer = kv_cache.view(-1, 1, 1, kv_cache.shape[-1])  # [pages, page_size 1, nhead_kv 1, L + R]
    out = q_latent.new_empty(num_tokens, num_heads, latent_dim)
    for g in range(groups):
        first = g * MLA_HEAD_GROUP
        n = min(MLA_HEAD_GROUP, num_heads - first)
        o = out if (groups == 1 and n == MLA_HEAD_GROUP) else q_latent.new_empty(num_tokens, MLA_HEAD_GROUP, latent_dim)
        ops.mla_decode_fwd(q[:, first:first + MLA_HEAD_GROUP].contiguous(), kv_buffer, o, md.qo_indptr,
                           md.kv_indptr, md.kv_indices, md.kv_last_page_lens, md.max_seqlen_q,
                           sm_scale=scale, q_scale=q_scale, kv_scale=kv_scale)
        if o is not out:
            out[:, first:first + n] = o[:, :n]
    return out


# ----------------------------------------------------------------------------- MXFP4 fused MoE

MOE_ALIGN = 256  # ATOM's Mxfp4MoEMethod pads hidden and intermediate sizes to 256 for aiter


def aiter_moe_problem(hidden_size: int, intermediate_size: int, quantize_activations: bool) -> str | None:
    """Why aiter's MXFP4 fused MoE cannot run these experts; None when it can.

    fused_moe with per_1x32, fp4x2 weights, SiLU and separated gate/up quantizes the activations
    to MXFP4 itself (aiter/fused_moe.py picks q_dtype_a = fp4x2): W4A4, the checkpoint's scheme.
    e8m0_shuffle pads scale rows to 256 and scale columns to 8 (= 256 inputs), and ATOM pads both
    sizes to 256 before aiter sees them; here sizes must already be multiples of 256 (Kimi-K2.5:
    hidden 7168, moe_intermediate 2048 / TP for TP <= 8), so nothing is padded."""
    if not quantize_activations:
        return ("aiter's MXFP4 MoE quantizes activations to MXFP4 itself (W4A4); "
                "--mxfp4-activations unquantized (W4A16) has no aiter kernel here")
    for what, size in (("hidden_size", hidden_size), ("moe_intermediate_size (per tensor-parallel rank)",
                                                       intermediate_size)):
        if size % MOE_ALIGN:
            return f"{what} {size} is not a multiple of {MOE_ALIGN}, which aiter's MXFP4 MoE layout needs"
    return None


class AiterMXFP4MoE:
    """One layer's routed experts through aiter.fused_moe. `shuffle_in_place` rearranges the loaded
    Quark tensors (w13 [E, 2I, H/2], w13_scale [E, 2I, H/32], w2 [E, H, I/2], w2_scale [E, H, I/32],
    all uint8) into aiter's layout once, in their own storage (no second copy of the experts)."""

    def __init__(self, ops: AiterOps | None = None):
        self.ops = ops if ops is not None else import_aiter()
        self._weights: tuple[torch.Tensor, ...] | None = None

    def shuffle_in_place(self, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                         w2_scale: torch.Tensor) -> None:
        if self._weights is not None:
            raise RuntimeError("these experts' weights are already in aiter's layout; shuffling twice scrambles them")
        for w in (w13, w2):
            for e in range(w.shape[0]):  # one expert at a time: a temporary of one expert, not of the layer
                w[e].copy_(self.ops.shuffle_weight(w[e], layout=(16, 16)).view(torch.uint8))
        scales = []
        for s in (w13_scale, w2_scale):
            flat = s.view(-1, s.shape[-1])  # ATOM shuffles the [E * rows, K / 32] view
            shuffled = self.ops.e8m0_shuffle(flat)
            if tuple(shuffled.shape) != tuple(flat.shape):
                raise ValueError(f"e8m0_shuffle padded scales {tuple(flat.shape)} to {tuple(shuffled.shape)}: "
                                 f"sizes must be multiples of {MOE_ALIGN} (aiter_moe_problem)")
            flat.copy_(shuffled.view(torch.uint8))
            scales.append(flat)
        # fused_moe recognises MXFP4 by w1.dtype == fp4x2 and picks preshuffled kernels by `is_shuffled`
        w1, w2_view = w13.view(self.ops.fp4x2), w2.view(self.ops.fp4x2)
        w1.is_shuffled = w2_view.is_shuffled = True
        self._weights = (w1, w2_view, *scales)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] (bf16), topk_weights [T, K], topk_ids [T, K] -> sum_k w_k expert_k(x) [T, H]."""
        if self._weights is None:
            raise RuntimeError("aiter experts ran before their weights were shuffled (process_weights_after_loading)")
        w1, w2, w1_scale, w2_scale = self._weights
        # routing as ATOM hands it to aiter: int32 ids, fp32 weights applied after the down projection
        return self.ops.fused_moe(x, w1, w2, topk_weights.float(), topk_ids.to(torch.int32), expert_mask=None,
                                  activation=self.ops.silu, quant_type=self.ops.per_1x32, doweight_stage1=False,
                                  w1_scale=w1_scale, w2_scale=w2_scale)
