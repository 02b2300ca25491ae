"""Verification of draft tokens against the target (docs/eagle3_semantics.md, "Verification").

Each sequence with n drafts brings n + 1 consecutive logits rows: row j scores the token after
draft j (row 0: after the last verified token). Greedy rows accept a draft while it equals the
target's argmax, then emit the argmax. Sampling rows use rejection sampling as vLLM does: accept
draft x with probability min(1, p(x) / q(x)); on the first rejection emit a token from
normalise(max(p - q, 0)); if all n pass, emit a bonus token from the last row's p. p is the
request's processed distribution (temperature, top-k, top-p), so the emitted tokens are
distributed exactly as plain sampling from the target would be. Logits processors (logit_bias,
min_tokens, penalties) are applied first, to every row with that row's own token history (see
model_ops/logits_processors.py), so p is the processed distribution at each position and greedy
rows compare drafts with the processed argmax: still exact. Our drafter proposes greedily,
so q is one-hot (draft_probs=None); general q is supported for drafters that sample.
A greedy row is the one-hot p of its argmax, which makes the same arithmetic exact there too.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from model_ops.logits_processors import LogitsProcessors
from model_ops.sampling import SamplingTensors, processed_probs, sample_from, uniform_noise


@dataclass
class Verified:
    num_accepted: list[int]  # per sequence
    token_ids: list[list[int]]  # per sequence: its accepted drafts, then one emitted token


def verify(logits: torch.Tensor, drafts: list[list[int]], st: SamplingTensors, shared: torch.Generator,
           draft_probs: torch.Tensor | None = None, forced_acceptance: int | None = None,
           processors: LogitsProcessors | None = None) -> Verified:
    """`logits` [R, V] holds len(drafts[b]) + 1 rows per sequence b, in order; `st` has one
    entry per row (a sequence's settings and generator repeated over its rows); `processors`,
    when given, are built for these rows (each with its own history); `draft_probs`,
    when given, has one row per draft token. `forced_acceptance` m (benchmarks only, like ATOM's
    --spec-decode-acceptance-length) accepts the first m drafts whatever they are and emits the
    target's argmax after them: a speed curve at exact acceptance lengths, not a lossless output."""
    sizes = [len(d) + 1 for d in drafts]
    if sum(sizes) != logits.shape[0]:
        raise ValueError(f"logits has {logits.shape[0]} rows for {len(drafts)} sequences needing {sum(sizes)}")
    if forced_acceptance is not None:
        return _verify_forced(logits.argmax(dim=-1).tolist(), drafts, forced_acceptance)
    if processors is not None:
        logits = processors(logits)
    if st.all_greedy and draft_probs is None:  # a host fact: no device read-back
        return _verify_greedy(logits.argmax(dim=-1).tolist(), drafts)

    device = logits.device
    p = processed_probs(logits, st)
    flat_drafts = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=device)
    starts = [0, *accumulate(sizes)][:-1]
    draft_rows = torch.tensor([start + j for start, d in zip(starts, drafts) for j in range(len(d))],
                              dtype=torch.long, device=device)
    row_gens = [st.generators[r] for r in draft_rows.tolist()]
    if draft_probs is None:
        q = torch.zeros_like(p[draft_rows]).scatter_(1, flat_drafts[:, None], 1.0)
    else:
        q = draft_probs.float()
    p_draft = p[draft_rows].gather(1, flat_drafts[:, None]).squeeze(1)
    q_draft = q.gather(1, flat_drafts[:, None]).squeeze(1)
    accept = uniform_noise(len(row_gens), row_gens, shared, device) < (p_draft / q_draft).clamp(max=1.0)

    # A rejected draft row emits from max(p - q, 0); a sequence's last row emits its bonus from p.
    residual = p.clone()
    residual[draft_rows] = (p[draft_rows] - q).clamp_min(0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # only when p == q exactly: then p itself
    residual = torch.where(empty, p, residual)
    emitted = sample_from(residual, st.generators, shared).tolist()

    accept = accept.tolist()
    num_accepted, tokens, row, k = [], [], 0, 0
    for d in drafts:
        a = 0
        while a < len(d) and accept[k + a]:
            a += 1
        num_accepted.append(a)
        tokens.append(list(d[:a]) + [emitted[row + a]])
        row, k = row + len(d) + 1, k + len(d)
    return Verified(num_accepted, tokens)


def _verify_greedy(argmax: list[int], drafts: list[list[int]]) -> Verified:
    num_accepted, tokens, row = [], [], 0
    for d in drafts:
        a = 0
        while a < len(d) and d[a] == argmax[row + a]:
            a += 1
        num_accepted.append(a)
        tokens.append(list(d[:a]) + [argmax[row + a]])
        row += len(d) + 1
    return Verified(num_accepted, tokens)


def _verify_forced(argmax: list[int], drafts: list[list[int]], m: int) -> Verified:
    num_accepted, tokens, row = [], [], 0
    for d in drafts:
        a = min(m, len(d))
        num_accepted.append(a)
        tokens.append(list(d[:a]) + [argmax[row + a]])
        row += len(d) + 1
    return Verified(num_accepted, tokens)
