"""How many drafts each step proposes: k from 0 (plain decoding) to num_speculative_tokens.

Speculation pays when the tokens a step gains outweigh what verifying and drafting cost, and
both sides move: acceptance falls with temperature, long contexts and off-domain prompts, and a
verify step's cost grows with the batch. `AdaptiveDraftLength` chooses, at the launch of every
step, the k that maximises expected tokens per second:

    rate(k) = (1 + E[accepted | k]) / T(batch, k)

- E[accepted | k] = sum_{j=1..k} prod_{i<j} a_i, from a_i, the running probability that draft
  position i is accepted when every position before it was (exponentially weighted per step,
  `AcceptanceTracker`). A position never reached borrows the estimate of the one before it.
- T(batch, k): what a step that verifies k drafts and proposes k more (the steady state) takes
  on this engine, per graph batch bucket: the periods such steps took (`StepTimes`: observed
  online, the lower quartile per bucket and k), and for a k not priced a guess from the priced
  ks and the device time the start-up profile measured for every k (`StepCosts`: replaying the
  captured decode graphs, cached on disk; `anchored`). Before anything is priced, and on CPU or
  without graphs (a fixed table), the profile alone. Periods, not device time: a small model's
  steps can be host-bound, and every k then costs about the same period, which device time
  alone would not show.

Timing on an overlapped pipeline: the drafts a step verifies were proposed by the step before,
so choosing k at the launch of step N decides what step N + 1 verifies. The host learns the
accepted counts of step N - 1 only after launching step N + 1 ... so the policy uses only steps
up to N - 2 when choosing for step N, with or without overlap: both modes then choose the same
k for the same batches.

k = 0 on a pure decode step skips the draft altogether (no cost left but the target's), so the
draft KV of the positions such steps decode is never written; when speculation resumes the draft
attends to those slots as they are (zeros or stale values). That costs acceptance, never
correctness: verification is exact whatever the drafts. Steps with prompt chunks always run the
draft's first pass, so a prompt's draft KV is never missing. While k = 0 nothing is observed, the
weights decay and the estimate drifts back to its prior: a periodic probe. Each probe that finds
nothing doubles the wait before the next (up to MAX_QUIET steps), so where speculation really does
not pay the probes cost next to nothing (AdaptiveDraftLength.choose).
"""
from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from spec_decode.step_costs import StepCosts, StepTimes, anchored, bucket_index

MAX_DRAFTS = 8  # the verify width the kernels are tested for: k + 1 <= 9 query tokens per sequence


_UNPRICED: dict[int, float] = {}  # the prices where the costs are a fixed table (AdaptiveDraftLength.step_times)


class DraftLengthPolicy(ABC):
    """Chooses k for each step. `observe` is told of the verifications of step `step` (counted
    from 0 at the engine's first launch) once the host has read them, all in one call."""

    max_drafts: int

    @abstractmethod
    def choose(self, step: int, num_seqs: int) -> int:
        """k in 0..max_drafts for step `step`, whose batch has `num_seqs` sampling sequences."""

    def observe(self, step: int, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """Sequence i of step `step` verified drafted[i] drafts and accepted the first accepted[i]."""

    def observe_step(self, num_seqs: int, k: int, period_seconds: float) -> None:
        """A steady decode step of `num_seqs` sequences at k drafts took `period_seconds` from its
        launch call to the next one's (host time plus the waits for the device)."""


class FixedDraftLength(DraftLengthPolicy):
    """Today's speculation: k every step (--no-speculative-adaptive)."""

    def __init__(self, k: int):
        self.max_drafts = self.k = k

    def choose(self, step: int, num_seqs: int) -> int:
        return self.k


class AcceptanceTracker:
    """Exponentially weighted conditional acceptance per draft position.

    Position i is *reached* by a verification that drafted more than i tokens and accepted the
    first i; it is accepted if the verification accepted more than i. Counts decay by `decay`
    per step; a_i = (accepted_i + w * prior_i) / (reached_i + w), with prior_0 = `prior` and
    prior_i = a_{i-1}: a position with no recent evidence follows the one before it.
    """

    def __init__(self, max_drafts: int, decay: float = 0.95, prior: float = 0.7, prior_weight: float = 0.1):
        self.decay, self.prior, self.prior_weight = decay, prior, prior_weight
        # Python lists, not numpy arrays: at most 8 positions, and the policy runs on the step's
        # critical path, where numpy's per-call cost was most of the policy's host time (below)
        self.reached = [0.0] * max_drafts
        self.accepted = [0.0] * max_drafts

    def end_step(self, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """Decay, then add one step's verifications (sequence i drafted drafted[i], accepted the
        first accepted[i])."""
        self.end_steps(1, [(0, drafted, accepted)])

    def end_steps(self, steps: int, verified: Sequence[tuple[int, Sequence[int], Sequence[int]]]) -> None:
        """End `steps` steps, the same counts as end_step step by step (a step without verifications
        only decays): (j, drafted, accepted) in `verified` are the verifications of the j-th of them
        (0-based, ascending), each weighted by the decays of the steps after it. One pass, as weighted histograms of min(accepted + 1,
        drafted) and accepted (position i is reached by the verifications whose value is > i, and
        accepted by those with accepted > i), not per sequence and position: on the GPU host the
        step-by-step merge of HOLD steps was most of the policy's time (2026-11-28,
        docs/benchmarks.md section 11)."""
        n, decay = len(self.reached), self.decay
        sizes = [len(drafted) for _, drafted, _ in verified]
        if sum(sizes) > 16:  # numpy's per-call cost is most of a small batch's (7 us against 3): one pass for all
            total = sum(sizes)
            a = np.fromiter(itertools.chain.from_iterable(acc for _, _, acc in verified), np.int64, total)
            d = np.fromiter(itertools.chain.from_iterable(dr for _, dr, _ in verified), np.int64, total)
            w = np.repeat([decay ** (steps - 1 - j) for j, _, _ in verified], sizes)
            reached = np.bincount(np.minimum(a + 1, d), weights=w, minlength=n + 1).tolist()
            hits = np.bincount(a, weights=w, minlength=n + 1).tolist()
        else:
            reached, hits = [0.0] * (n + 1), [0.0] * (n + 1)
            for j, drafted, accepted in verified:
                w = decay ** (steps - 1 - j)
                for d, a in zip(drafted, accepted):
                    reached[a + 1 if a < d else d] += w
                    hits[a] += w
        # the old counts decayed by the `steps` steps, plus the suffix sums of the new ones (values > i),
        # in one pass from the last position down
        factor = decay ** steps
        old_reached, old_accepted = self.reached, self.accepted
        r = h = 0.0
        for i in range(n, 0, -1):
            r += reached[i]
            h += hits[i]
            reached[i] = old_reached[i - 1] * factor + r
            hits[i] = old_accepted[i - 1] * factor + h
        self.reached, self.accepted = reached[1:], hits[1:]

    def rates(self) -> list[float]:
        out, prior, w = [], self.prior, self.prior_weight
        for reached, accepted in zip(self.reached, self.accepted):
            prior = (accepted + w * prior) / (reached + w)
            out.append(prior)
        return out

    def expected_accepted(self) -> list[float]:
        """E[accepted drafts] for k = 0..max_drafts."""
        out, total, survive = [0.0], 0.0, 1.0
        for a in self.rates():
            total += survive * a
            out.append(total)
            survive *= a
        return out


class AdaptiveDraftLength(DraftLengthPolicy):
    """k = argmax rate(k) (module note), from the acceptance of steps up to N - 2, worked out
    afresh every HOLD steps of a batch bucket and held in between. Why: the policy runs on the
    host at every step's launch, and a small model's steps are host-bound, so its time is the
    step's. Worked out at every step, with medians and prices updated at every sample, its calls
    took 64 us a step on an H100 host (a 2.1 GHz Xeon; SmolLM2 shape, batch 1, 2026-11-27), and
    its steps took 1.31 ms where a fixed k = 0's took 1.24 with k = 0 forced on both: 6% of every
    step, where the goal is 0.98x no speculation. A choice held for a few steps costs next to
    nothing: where k changes, the rates of the two ks are about equal. A change of bucket is
    worked out at once.

    A choice of k = 0 holds longer after probes that found nothing: back at k = 0 within PROBE
    choices of drafts, the wait doubles (HOLD up to MAX_QUIET steps); a longer run of drafts
    resets it. Why: on the SmolLM2 pair at batch 1, T = 1 (H100, 2026-11-27) every fixed k lost
    17-23% to k = 0, and the probes the decaying evidence brought every ~60 steps (9.5% of steps
    drafted) held the policy at 0.95-0.96x no speculation in three runs; with the doubling, 0.99x
    [0.98, 0.99] in the same run as 0.97x without it.

    The mirror image while drafting: once REPRICE_AFTER period samples of other ks have come since
    k = 0's latest, a choice to draft instead drops k = 0's samples and runs k = 0 for REPRICE_RUN
    steps, so that k = 0 is priced in the host's current phase; if drafting still wins once k = 0 is
    priced again, the wait doubles (up to REPRICE_MAX), else it starts over. Why: a price is
    refreshed only while its k runs, and the GPU host runs in phases up to 2x slower for hundreds of
    steps. On the SmolLM2 pair at batch 1, T = 1 (H100, 2026-11-27) k = 0's price was taken in such a
    phase, drafting looked cheaper, and the policy drafted 564 steps in a row at 0.92x no speculation
    (every fixed k lost 17-34% there). Replayed against the phases the zoo runs recorded
    (docs/benchmarks.md section 11, "Replaying the policy"), batch 1, T = 1 went from 0.96-0.99x to
    0.99-1.00x no speculation; the other points moved by 1.1% or less either way."""

    HOLD, PROBE, MAX_QUIET = 4, 3, 256
    REPRICE_AFTER, REPRICE_RUN, REPRICE_MAX = 256, 5, 4096

    def __init__(self, max_drafts: int, costs: StepCosts, tracker: AcceptanceTracker | None = None):
        self.max_drafts, self.costs = max_drafts, costs
        self.tracker = tracker or AcceptanceTracker(max_drafts)
        self.times = StepTimes(costs.buckets)
        self._pending: dict[int, tuple[Sequence[int], Sequence[int]]] = {}  # step -> its verifications
        self._merged = -1  # the last step merged into the tracker
        self._held = (-1, -1, -1, 0)  # (the step the choice holds until, its batch size, its bucket, k)
        self._drafting = 0  # choices of k >= 1 in a row
        self._quiet = self.HOLD  # how long a choice of k = 0 holds (see choose)
        self._step_times: dict[int, tuple[dict[int, float], list[float]]] = {}  # batch -> (the prices, T(batch, k))
        self._since_k0: dict[int, int] = {}  # bucket -> period samples of other ks since k = 0's latest (see choose)
        self._reprice_wait, self._repriced = self.REPRICE_AFTER, False

    def observe(self, step: int, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        if step > self._merged:  # (a step already merged cannot be observed: see choose)
            self._pending[step] = (drafted, accepted)  # kept, not copied, until merged: the engine's are fresh lists

    def observe_step(self, num_seqs: int, k: int, period_seconds: float) -> None:
        b = self.times.observe(num_seqs, k, period_seconds)
        self._since_k0[b] = self._since_k0.get(b, 0) + 1 if k else 0

    def step_times(self, num_seqs: int) -> list[float]:
        """T(batch, k) for k = 0..max_drafts (module note). Worked out again only when the prices
        moved (StepTimes.observed hands back the same dict until then)."""
        # (the fixed table's units are not seconds: never mixed with periods)
        seen = self.times.observed(num_seqs) if self.costs.measured else _UNPRICED
        cached = self._step_times.get(num_seqs)
        if cached is not None and cached[0] is seen:
            return cached[1]
        device = self.costs.step_times(num_seqs)[: self.max_drafts + 1]
        times = anchored(seen, device) if seen else device
        self._step_times[num_seqs] = (seen, times)
        return times

    def choose(self, step: int, num_seqs: int) -> int:
        until, held_seqs, held_bucket, k = self._held
        if step < until and num_seqs == held_seqs:  # (the common case, without the bucket search)
            return k
        bucket = bucket_index(self.costs.buckets, num_seqs)
        if step < until and bucket == held_bucket:
            return k
        upto = step - 2
        if upto > self._merged:  # steps without verifications only decay: counted, not visited one by one
            first = self._merged + 1
            ready = sorted(s for s in self._pending if s <= upto)
            self.tracker.end_steps(upto - self._merged, [(s - first, *self._pending.pop(s)) for s in ready])
            self._merged = upto
        gain = self.tracker.expected_accepted()
        times = self.step_times(max(num_seqs, 1))
        best, best_rate = 0, (1 + gain[0]) / times[0]
        for k in range(1, self.max_drafts + 1):  # the smallest k of the highest rate
            rate = (1 + gain[k]) / times[k]
            if rate > best_rate:
                best, best_rate = k, rate
        if self._repriced and 0 in self.times.observed(num_seqs):
            # k = 0 priced afresh: drafting again means its old price was not the problem, so wait longer
            self._repriced = False
            self._reprice_wait = min(2 * self._reprice_wait, self.REPRICE_MAX) if best else self.REPRICE_AFTER
        elif best and self._since_k0.get(bucket, 0) > self._reprice_wait and not self._repriced:
            self.times.forget(num_seqs, 0)
            self._since_k0[bucket], self._repriced = 0, True
            self._held = (step + self.REPRICE_RUN, num_seqs, bucket, 0)
            return 0
        if best:
            self._drafting += 1
            hold = self.HOLD
        else:
            # back at k = 0 after at most PROBE choices of drafts: a probe that found nothing, so wait
            # twice as long for the next; after a longer run of drafts, probe soon again
            if 0 < self._drafting <= self.PROBE:
                self._quiet = min(2 * self._quiet, self.MAX_QUIET)
            elif self._drafting:
                self._quiet = self.HOLD
            self._drafting = 0
            hold = self._quiet
        self._held = (step + hold, num_seqs, bucket, best)
        return best
