"""Sampling and speculative verification on the device: the math behind atom_like's Sampler
(engine/sampler.py, which builds these tensors from a step's requests).

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is an exact draw
from p, needs no cumsum/searchsorted, and lets each request draw its noise from its own seeded
generator, so a seeded request gets the same tokens whatever else shares its batch.
"""
from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from model_ops.logits_processors import LogitsProcessors


@dataclass
class SamplingTensors:
    """Per-row sampling settings; a row with temperature 0 is greedy."""
    temperature: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] int64, vocab size when off
    top_p: torch.Tensor  # [R] float32
    generators: list[torch.Generator | None]  # per-row RNG (None: the shared one)
    # every row is greedy: known on the host, so the greedy path never reads it back from the device
    all_greedy: bool
    # the rows that draw from the shared generator, on the device (None: every row does), so
    # that noise is scattered into them without a Python-list index (a blocking upload)
    shared_rows: torch.Tensor | None = None
    # host facts that let processed_probs skip whole passes over [rows, vocab]: how many of each
    # row's largest logits the top-k / top-p filters need in order (0: no row filters, no sort; the
    # largest top-k when every row has one: a top-k, not a sort of the vocabulary; else the
    # vocabulary), and whether some row is greedy (the one-hot rows)
    sort_width: int | None = None  # None: the whole vocabulary
    any_greedy: bool = True

    @classmethod
    def build(cls, temperature: list[float], top_k: list[int], top_p: list[float],
              generators: list[torch.Generator | None], vocab_size: int, device: torch.device) -> "SamplingTensors":
        def upload(values: list, dtype: torch.dtype) -> torch.Tensor:
            # a blocking host-to-GPU copy synchronizes the stream (the host waits for every queued
            # kernel); this one is ordered before the kernels that read it, and the source is
            # pageable memory the driver stages before returning, so nothing waits
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperature=upload(temperature, torch.float32),
            top_k=upload([vocab_size if k < 1 else min(k, vocab_size) for k in top_k], torch.int64),
            top_p=upload(top_p, torch.float32),
            generators=generators,
            all_greedy=all(t == 0 for t in temperature),
            shared_rows=_shared_rows(generators, device),
            sort_width=_sort_width(top_k, top_p, vocab_size),
            any_greedy=any(t == 0 for t in temperature),
        )

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature == 0


def _sort_width(top_k: list[int], top_p: list[float], vocab_size: int) -> int | None:
    """SamplingTensors.sort_width: a row without a top-k but with a top-p needs its whole order, and
    one without either keeps every token, so only a batch where every row has a top-k gets away with
    its largest."""
    kept = [min(k, vocab_size) if k >= 1 else vocab_size for k in top_k]
    if all(k == vocab_size for k in kept) and all(p >= 1.0 for p in top_p):
        return 0
    return max(kept) if max(kept) < vocab_size else None


ARGMAX_CHUNKS = 64
ARGMAX_MIN_VOCAB = 100_000


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary (the first maximum on ties, as torch.argmax). A GPU reduces a
    few long rows in one thread block each: at batch 1 the argmax over 128,256 logits took 27.5
    µs on an H100 (docs/benchmarks.md section 8), for 0.5 MB. Split into ARGMAX_CHUNKS pieces
    a row, the maxima run on 64 blocks and a second tiny argmax picks among them; the first
    maximum of the first maximal chunk is the first maximum of the row. Measured in CUDA graphs:
    26.8 -> 17.6 µs at 128,256 entries, but slower at 49,152 (12.2 -> 13.6) and 32,000 (9.2 ->
    13.2), where one block a row is still short: hence the 100k threshold."""
    rows, vocab = logits.shape
    if not logits.is_cuda or rows > 8 or vocab % ARGMAX_CHUNKS or vocab < ARGMAX_MIN_VOCAB:
        return logits.argmax(dim=-1)
    best, where = logits.reshape(rows, ARGMAX_CHUNKS, vocab // ARGMAX_CHUNKS).max(dim=-1)
    chunk = best.argmax(dim=-1, keepdim=True)
    return (chunk * (vocab // ARGMAX_CHUNKS) + where.gather(1, chunk)).squeeze(1)


def processed_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution a request samples from: softmax(logits / T) restricted to its top-k,
    then to the smallest prefix whose mass reaches top-p (always keeping the most likely token).
    Greedy rows get the one-hot of their argmax.

    Without a top-k or top-p in the batch the sort and its passes are skipped (the same
    distribution): every pass is over [rows, vocab] fp32, rows = sequences x (drafts + 1), and
    the sort was the largest. On an H100 at batch 128, temperature 1 (SmolLM2, 49,152 tokens),
    steps grew ~0.8 ms a draft with it (2026-11-27). When every row has a top-k, only the largest
    top-k logits are ordered (torch.topk), not the vocabulary."""
    vocab = logits.shape[-1]
    width = vocab if st.sort_width is None else st.sort_width
    temp = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature) if st.any_greedy else st.temperature
    scaled = logits.float() / temp[:, None]
    if width:
        sorted_logits, order = (scaled.topk(width, dim=-1) if width < vocab else scaled.sort(dim=-1, descending=True))
        rank = torch.arange(width, device=logits.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(rank >= st.top_k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill((mass_before >= st.top_p[:, None]) & (rank > 0), 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        probs = torch.zeros_like(scaled).scatter_(1, order, sorted_probs)
    else:
        probs = scaled.softmax(dim=-1)
    if not st.any_greedy:
        return probs
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(st.greedy[:, None], one_hot, probs)


def _shared_rows(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor | None:
    """The rows without a generator of their own, on the device; None when that is every row."""
    if all([g is None for g in generators]):  # a list, not a generator: that is a Python call a row
        return None
    return _to(np.array([i for i, g in enumerate(generators) if g is None], dtype=np.int64), device)


def exponential_noise(shape: tuple[int, int], generators: list[torch.Generator | None],
                      shared_rows: torch.Tensor | None, shared: torch.Generator, device: torch.device) -> torch.Tensor:
    """Exp(1) noise, row i from generators[i]: the rows without one (`shared_rows`, None for all)
    get one draw from `shared`, in row order; each other row its own generator's draw."""
    if shared_rows is None:
        return torch.empty(shape, device=device).exponential_(generator=shared).clamp_min_(1e-20)
    noise = torch.empty(shape, device=device)
    if len(shared_rows):
        noise.index_copy_(0, shared_rows, torch.empty(len(shared_rows), shape[1], device=device).exponential_(generator=shared))
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise.clamp_min_(1e-20)


def uniform_noise(generators: list[torch.Generator | None], shared_rows: torch.Tensor | None, shared: torch.Generator,
                  device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row, from the row's generator (shared rows as in exponential_noise)."""
    if shared_rows is None:
        return torch.rand(len(generators), device=device, generator=shared)
    out = torch.empty(len(generators), device=device)
    if len(shared_rows):
        out.index_copy_(0, shared_rows, torch.rand(len(shared_rows), device=device, generator=shared))
    for i, g in enumerate(generators):
        if g is not None:
            out[i] = torch.rand(1, device=device, generator=g)[0]
    return out


def sample_from(probs: torch.Tensor, st: SamplingTensors, shared: torch.Generator) -> torch.Tensor:
    """One exact draw per row of `probs` (rows need not be normalised), from each row's generator."""
    noise = exponential_noise(tuple(probs.shape), st.generators, st.shared_rows, shared, probs.device)
    return (probs / noise).argmax(dim=-1)


# ----------------------------------------------------------------------------- verification

@dataclass
class Verified:
    """One step's tokens, on the logits' device. Row s holds sequence s's accepted drafts, then
    the token it emits, then -1 padding; `num_accepted[s]` counts the accepted drafts."""
    token_ids: torch.Tensor  # [S, K + 1] int64
    num_accepted: torch.Tensor  # [S] int64
    row_index: torch.Tensor  # [S, K + 1]: the logits row that scored token_ids[s, j] (clamped to s's last row)

    def lists(self) -> tuple[list[int], list[list[int]]]:
        """(accepted counts, emitted tokens) on the host: a device read, for callers that want it now."""
        accepted, rows = self.num_accepted.tolist(), self.token_ids.tolist()
        return accepted, [row[:a + 1] for a, row in zip(accepted, rows)]


@dataclass
class DraftLayout:
    """Where a step's rows and drafts sit, per sequence: sequence s owns num_drafts[s] + 1
    consecutive logits rows (row j scores the token after its first j drafts), and `draft_ids`
    holds every sequence's drafts, flattened in the same order. Built on the host from the
    counts, so no device value is read."""
    row_start: np.ndarray  # [S] host: each sequence's first row
    row_index: torch.Tensor  # [S, K + 1]: the row scoring the token after s's first j drafts (clamped to s's last)
    valid: torch.Tensor  # [S, K]: j < num_drafts[s]
    draft_ids: torch.Tensor  # [D] every sequence's drafts, flattened
    draft_index: torch.Tensor  # [S, K]: where s's draft j sits in draft_ids (clamped; masked by `valid`)
    draft_rows: np.ndarray  # [D] host: the logits row that scores each draft, in draft_ids' order

    @functools.cached_property
    def drafts(self) -> torch.Tensor:
        """[S, K] s's draft j (entries past its drafts are masked by `valid`); gathered when first
        read (the greedy kernel reads draft_ids itself)."""
        return self.draft_ids[self.draft_index] if self.draft_index.shape[1] else self.draft_ids.new_zeros(self.draft_index.shape)

    @classmethod
    def of(cls, logits: torch.Tensor, num_drafts: list[int], draft_ids: torch.Tensor) -> "DraftLayout":
        num_seqs, num_rows = len(num_drafts), logits.shape[0]
        if sum(num_drafts) + num_seqs != num_rows or draft_ids.numel() != sum(num_drafts):
            raise ValueError(f"logits has {num_rows} rows and draft_ids {draft_ids.numel()} tokens for "
                             f"{num_seqs} sequences with {sum(num_drafts)} drafts")
        row_start, row_index, valid, draft_index, draft_rows = _layout(tuple(num_drafts), logits.device)
        return cls(row_start, row_index, valid, draft_ids, draft_index, draft_rows)

    def plain(self, emitted: torch.Tensor) -> Verified:
        """`verified` when no sequence has a draft: each emits its one row's token (`emitted` [S])."""
        return Verified(emitted[:, None], emitted.new_zeros(emitted.shape[0]), self.row_index)

    def verified(self, emitted: torch.Tensor, accept: torch.Tensor) -> Verified:
        """Each sequence keeps its drafts up to its first rejected one (`accept` [S, K]), then emits
        what the row after them would (`emitted` [R])."""
        num_seqs, width = self.drafts.shape
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
        last = emitted[self.row_index].gather(1, num_accepted[:, None])
        cols = torch.arange(width + 1, device=emitted.device)[None, :]
        padded = torch.cat([self.drafts, self.drafts.new_full((num_seqs, 1), -1)], dim=1)
        tokens = torch.where(cols < num_accepted[:, None], padded, torch.where(cols == num_accepted[:, None], last, -1))
        return Verified(tokens, num_accepted, self.row_index)


@functools.lru_cache(maxsize=16)
def _layout(num_drafts: tuple[int, ...], device: torch.device) -> tuple:
    """DraftLayout's parts that depend on the draft counts alone, kept for the last 16 patterns (read
    only): a decode batch keeps its pattern from step to step, and rebuilding them took three uploads a
    step on every engine (a plain one too: its counts are all 0)."""
    num_seqs, width = len(num_drafts), max(num_drafts, default=0)
    n = np.array(num_drafts, dtype=np.int64)
    row_start = np.concatenate([[0], np.cumsum(n + 1)[:-1]]) if num_seqs else n
    draft_start = row_start - np.arange(num_seqs)
    j = np.arange(width + 1)[None, :]
    row_index = _to(row_start[:, None] + np.minimum(j, n[:, None]), device)
    valid = _to(j[:, :width] < n[:, None], device)
    # clamped into range for the gather; `valid` masks what lies past a sequence's drafts
    draft_index = _to(np.minimum(draft_start[:, None] + j[:, :width], max(int(n.sum()) - 1, 0)), device)
    return row_start, row_index, valid, draft_index, np.repeat(row_start, n) + segment_ranks(n)


class Verifier(Protocol):
    """The rule that turns a step's logits and drafts into its tokens (`verify` below)."""

    def __call__(self, logits: torch.Tensor, num_drafts: list[int], draft_ids: torch.Tensor, st: SamplingTensors,
                 shared: torch.Generator, processors: LogitsProcessors | None = None) -> Verified: ...


def verify(logits: torch.Tensor, num_drafts: list[int], draft_ids: torch.Tensor, st: SamplingTensors,
           shared: torch.Generator, processors: LogitsProcessors | None = None,
           draft_probs: torch.Tensor | None = None) -> Verified:
    """Sample every sequence's next token, verifying its draft tokens first (docs/eagle3_semantics.md,
    "Verification"), entirely on the device: no host read, so the host can prepare the next step
    while this one runs.

    Sequence s owns num_drafts[s] + 1 consecutive rows of `logits` [R, V], in order: row j scores
    the token after its first j drafts (without drafts this is plain sampling). `draft_ids` [D]
    holds every sequence's drafts, flattened in the same order; `st` has one entry per row (a
    sequence's settings and generator repeated over its rows); `processors`, when given, are
    built for these rows, each with its own token history; `draft_probs` [D, V], when given, is
    the draft's distribution q (None: q is one-hot, as our greedy drafters propose).

    Greedy rows accept a draft while it equals the (processed) argmax, then emit the argmax.
    Sampling rows use rejection sampling as vLLM does: accept draft x with probability
    min(1, p(x) / q(x)); on the first rejection emit from normalise(max(p - q, 0)); when all
    pass, emit a bonus token from the last row's p. p is the request's processed distribution
    (processors, temperature, top-k, top-p), so the emitted tokens are distributed exactly as
    plain sampling from the target would be; a greedy row's p is the one-hot of its argmax,
    which makes the same arithmetic exact there too.
    """
    layout = DraftLayout.of(logits, num_drafts, draft_ids)
    if processors is not None:
        logits = processors(logits)
    if not layout.valid.shape[1]:  # nothing to verify: plain sampling (the general path's ~15 ops on empty tensors skipped)
        return layout.plain(greedy_tokens(logits) if st.all_greedy else sample_from(processed_probs(logits, st), st, shared))
    if st.all_greedy and draft_probs is None:  # a host fact: no device read-back
        emitted = greedy_tokens(logits)
        kernel = _greedy_verify_kernel(logits.device)
        if kernel is not None:
            tokens, accepted = kernel(emitted, draft_ids, layout.row_index, layout.draft_index, layout.valid)
            return Verified(tokens, accepted, layout.row_index)
        accept = layout.valid & (layout.drafts == emitted[layout.row_index[:, :-1]])
    elif (kernel := _sampled_verify_kernel(logits.device, st, draft_probs)) is not None:
        # the torch path's draws in its order (a uniform per draft, then the exponentials over every
        # row), so that a seed gives the same tokens; the kernel does what ~30-50 small ops do after them
        uniform = uniform_noise([None] * len(layout.draft_rows), None, shared, logits.device)
        noise = exponential_noise(tuple(logits.shape), st.generators, None, shared, logits.device)
        tokens, accepted = kernel(logits, st.temperature, uniform, noise, draft_ids, layout.row_index,
                                  layout.draft_index, layout.valid)
        return Verified(tokens, accepted, layout.row_index)
    else:
        emitted, accepted_flat = _rejection_sample(logits, layout, st, shared, draft_probs)
        # a gather, not a boolean-mask assignment: that one reads the mask's count back to the host
        accept = layout.valid & accepted_flat[layout.draft_index] if accepted_flat.numel() else layout.valid.clone()
    return layout.verified(emitted, accept)


@functools.cache
def _greedy_verify_kernel(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """kernels_rocm.greedy_verify on a GPU with triton: one launch for what the comparison and
    DraftLayout.verified do in ~16 (None: the torch path, the CPU's)."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from kernels_rocm.greedy_verify import greedy_verify

    return greedy_verify


def _sampled_verify_kernel(device: torch.device, st: SamplingTensors,
                           draft_probs: torch.Tensor | None) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """kernels_rocm.sampled_verify on a GPU with triton, for the common sampled step, decided from host
    facts: no top-k / top-p (`sort_width` 0: p is the plain softmax, or a greedy row's one-hot), q the
    draft's one-hot (`draft_probs` None) and every draw from the shared generator (no seeded request:
    `shared_rows` None); greedy rows may sit beside the sampled ones (verify sends a step of greedy
    rows only to greedy_verify first). Two launches for _rejection_sample's and DraftLayout.verified's
    ~30-50 ops. None: the torch path (the CPU's, and every other step's)."""
    if st.sort_width != 0 or draft_probs is not None or st.shared_rows is not None:
        return None
    return _sampled_kernel(device)


@functools.cache
def _sampled_kernel(device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from kernels_rocm.sampled_verify import sampled_verify

    return sampled_verify


def _rejection_sample(logits: torch.Tensor, layout: DraftLayout, st: SamplingTensors,
                      shared: torch.Generator, draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the token each row would emit [R], whether each draft is accepted [D])."""
    draft_ids = layout.draft_ids
    device = logits.device
    p = processed_probs(logits, st)
    draft_rows = _to(layout.draft_rows, device)
    p_rows = p[draft_rows]
    p_draft = p_rows.gather(1, draft_ids[:, None]).squeeze(1)
    if draft_probs is None:  # q is the draft's one-hot: max(p - q, 0) is p without the draft's entry
        q_draft = torch.ones_like(p_draft)
        residual = p_rows.scatter(1, draft_ids[:, None], 0.0)
    else:
        q = draft_probs.float()
        q_draft = q.gather(1, draft_ids[:, None]).squeeze(1)
        residual = (p_rows - q).clamp_min(0.0)
    if st.shared_rows is None:  # no seeded request: every draw from the shared generator
        row_gens, shared_rows = [None] * len(layout.draft_rows), None
    else:
        row_gens = [st.generators[r] for r in layout.draft_rows]
        shared_rows = _shared_rows(row_gens, device)
    accept = uniform_noise(row_gens, shared_rows, shared, device) < (p_draft / q_draft).clamp(max=1.0)
    # a rejected draft's row emits from max(p - q, 0), written over p's row (p is this call's own:
    # no copy of all rows); a sequence's last row emits its bonus from p
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # only when p == q exactly: then p itself
    p[draft_rows] = torch.where(empty, p_rows, residual)
    return sample_from(p, st, shared), accept


def segment_ranks(counts: np.ndarray) -> np.ndarray:
    """0..counts[b] - 1 for each b, concatenated (the offsets inside consecutive segments)."""
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`, copied without waiting for the device (the copy is ordered
    before the kernels that read it)."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)
