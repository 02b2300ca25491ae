"""What a decode step costs, for the adaptive draft length (spec_decode/adaptive.py): the device
time per batch bucket and k, profiled at start-up (`StepCosts`), and the periods steady steps took
on this engine (`StepTimes`, timed by `StepClock`), which `anchored` extends to the ks not priced.
The policy's rate(k) divides expected tokens by these."""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)


def bucket_index(buckets: list[int], num_seqs: int) -> int:
    """The smallest bucket holding num_seqs sequences (the largest past them all); buckets ascending."""
    return min(bisect.bisect_left(buckets, num_seqs), len(buckets) - 1)


@dataclass
class StepCosts:
    """Seconds (or any common unit) of a decode step at batch bucket `buckets[b]` that verifies k
    drafts and proposes k: `seconds[b][k]`, k = 0..max_drafts."""
    buckets: list[int]
    seconds: list[list[float]]
    source: str  # "measured on <device>", "cache <path>" or "fixed table"

    @property
    def measured(self) -> bool:
        """Seconds measured on this device (now or cached), not a table in relative units."""
        return self.source.startswith(("measured", "cache"))

    def step_times(self, num_seqs: int) -> list[float]:
        """Seconds of a step of num_seqs sequences for every k, 0..max_drafts."""
        b = bucket_index(self.buckets, num_seqs)
        # past the largest bucket (eager steps): grow with the batch, as a verify step does
        grow = num_seqs / self.buckets[b] if num_seqs > self.buckets[b] else 1.0
        return [t * grow for t in self.seconds[b]]

    @classmethod
    def fixed(cls, buckets: list[int], max_drafts: int) -> "StepCosts":
        """Where nothing was measured (CPU, --enforce-eager): a plain step costs 1; each draft adds
        a draft forward (0.06) and, growing with the batch, verify work (0.004 per sequence)."""
        return cls(list(buckets), [[1.0 + k * (0.06 + 0.004 * n) for k in range(max_drafts + 1)] for n in buckets],
                   "fixed table")

    # ------------------------------------------------------------------ the on-disk cache

    @staticmethod
    def cache_path(key: dict) -> str:
        root = os.environ.get("ATOM_LIKE_SPEC_COSTS_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "atom_like", "spec_costs")
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return os.path.join(root, f"{digest}.json")

    @classmethod
    def load(cls, key: dict) -> "StepCosts | None":
        path = cls.cache_path(key)
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        if data.get("key") != key:  # a hash collision or an older format: measure again
            return None
        return cls(data["buckets"], data["seconds"], f"cache {path}")

    def save(self, key: dict) -> None:
        path = self.cache_path(key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump({"key": key, **asdict(self)}, f)
            os.replace(path + ".tmp", path)
        except OSError as e:  # a read-only home costs a profile per start, nothing else
            logger.warning("could not cache the decode step costs at %s: %s", path, e)


class StepTimes:
    """Seconds of steady decode steps (the same k three launches in a row: StepClock), per batch
    bucket and k: the period from a step's launch call to the next one's, which is what a step
    costs whether the host or the device bounds it.

    A k's price is the lower quartile of its last WINDOW periods, once MIN_SAMPLES exist. Why a
    low quantile, and why periods (2026-11-27, docs/benchmarks.md section 11, "Prices from the
    fast phases"): the GPU host runs in phases 1.5-2x slower for tens to hundreds of steps, and
    the policy leaves a k when its price rises, i.e. in such a phase, so a median of a k's last
    samples kept the slow phase it was left in. On the SmolLM2 pair (H100) the ks the policy
    had left were priced 40-140% above what fixed modes at those ks took, the policy locked in
    on its running k (k = 4-5 at batch 1, T = 0, where k = 2 was 25% faster: 0.71x the best
    fixed k in two runs), and which k that was changed from run to run. A lower quartile prices
    every k at its fast-phase cost; one-sided noise (a first-use compile: 87 ms among 1.7 ms
    steps) stays out of it. Host time alone (the period less the host's waits) under-priced the
    ks whose steps are bound by neither side: at batch 8 its lower quartile put k = 5 at 1.28 ms
    where its steps took 1.79.

    Nor does a k cost more than OUTLIER^|k - j| times any other priced k j: a step grows with k by
    far less (the fixed modes' median steps at most 1.37x from one k to the next in three SmolLM2
    runs on H100s), and a price that stands apart so far came from a bad start. At batch 1 on the
    8B shape (2026-11-27, forced acceptance 4) k = 4's first three samples took 14.5 ms where
    k = 3's took 1.4, and no later step ran k = 4 to correct it: 0.89x the best fixed k."""

    WINDOW, MIN_SAMPLES, OUTLIER = 32, 3, 2.0

    def __init__(self, buckets: list[int]):
        self.buckets = list(buckets)
        self._samples: dict[tuple[int, int], deque[float]] = defaultdict(lambda: deque(maxlen=self.WINDOW))
        # per bucket, {k: lower quartile} of the ks with MIN_SAMPLES samples, and {k: price}, those
        # capped, brought up to date when read (`_refresh`): observe runs at every steady step,
        # the policy reads every few (AdaptiveDraftLength.HOLD)
        self._quartiles: dict[int, dict[int, float]] = defaultdict(dict)
        self._prices: dict[int, dict[int, float]] = defaultdict(dict)
        self._dirty: dict[int, set[int]] = defaultdict(set)  # per bucket, the ks sampled since
        self._bucket_of: dict[int, int] = {}  # batch size -> bucket: observe runs at every steady step

    def _bucket(self, num_seqs: int) -> int:
        b = self._bucket_of.get(num_seqs)
        if b is None:
            b = self._bucket_of[num_seqs] = bucket_index(self.buckets, num_seqs)
        return b

    def observe(self, num_seqs: int, k: int, seconds: float) -> int:
        """Count a sample; returns the index of the bucket it counts in."""
        b = self._bucket(num_seqs)
        self._samples[b, k].append(seconds)
        self._dirty[b].add(k)
        return b

    def _refresh(self, b: int) -> None:
        """Bucket b's quartiles and prices from its samples: a new prices dict where a quartile moved,
        else the same one (`observed`)."""
        dirty = self._dirty.pop(b, None)
        if dirty:
            quartiles, moved = self._quartiles[b], False
            for k in dirty:
                samples = self._samples[b, k]
                if len(samples) >= self.MIN_SAMPLES:
                    q = _typical(samples)
                    if quartiles.get(k) != q:
                        quartiles[k], moved = q, True
            if moved:
                self._prices[b] = _capped(quartiles, self.OUTLIER)

    def forget(self, num_seqs: int, k: int) -> None:
        """Drop k's samples at num_seqs's bucket: k is unpriced until MIN_SAMPLES new ones come."""
        b = self._bucket(num_seqs)
        self._samples.pop((b, k), None)
        if self._quartiles[b].pop(k, None) is not None:
            self._prices[b] = _capped(self._quartiles[b], self.OUTLIER)

    def observed(self, num_seqs: int) -> dict[int, float]:
        """{k: seconds} at num_seqs's bucket, for the ks with MIN_SAMPLES samples. Not to be changed by
        the caller: the same dict comes back until a price moves, so that a caller may keep what it
        worked out from it (AdaptiveDraftLength.step_times)."""
        b = self._bucket(num_seqs)
        self._refresh(b)
        return self._prices[b]


def _typical(values) -> float:
    """The lower quartile of the values (StepTimes: each k at its fast-phase cost)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 4]


def _capped(typical: dict[int, float], factor: float) -> dict[int, float]:
    """{k: min over priced j of typical[j] * factor^|k - j|}, in ascending k: one pass up, one down."""
    ks = sorted(typical)
    out = [typical[k] for k in ks]
    # (comparisons, not min(), and the power only across a gap: the policy's host time, StepTimes._refresh)
    for i in range(1, len(ks)):
        gap = ks[i] - ks[i - 1]
        cap = out[i - 1] * (factor if gap == 1 else factor ** gap)
        if cap < out[i]:
            out[i] = cap
    for i in range(len(ks) - 2, -1, -1):
        gap = ks[i + 1] - ks[i]
        cap = out[i + 1] * (factor if gap == 1 else factor ** gap)
        if cap < out[i]:
            out[i] = cap
    return dict(zip(ks, out))


def anchored(prices: dict[int, float], device: list[float]) -> list[float]:
    """Seconds of a step at every k of `device` (the start-up profile's), from the priced ks: a
    priced k its price; between two priced ks the line through them; above them the highest priced
    k's price moved by the profile's difference (never below the profile); below them the profile
    alone, the one bound a period cannot beat, so the policy tries such a k and its samples price it.

    Why the profile's difference and not the slope of two prices: a step's cost is not linear in k.
    On the SmolLM2 pair at batch 128 (H100, 2026-11-27) k = 1 cost 3 ms more than k = 0 and k = 5
    only 0.9 ms more than k = 1; along the slope of k = 0 and 1 k = 4 looked 18 ms, and the policy
    never tried it (fixed k = 4: 9.0 ms, the best mode). Why not a priced k's period less the
    profile's difference below it: that keeps the host time k = 0 skips (the draft's launches); at
    batch 8, T = 1 in the trace simulator k = 0 then looked 2.51 ms beside k = 1's 2.61, was never
    run, and took 2.29 (0.91x it)."""
    if len(prices) == len(device) and max(prices) == len(device) - 1:  # every k priced (ks are 0, 1, ...)
        return [prices[k] for k in range(len(device))]
    ks = sorted(prices)
    out = []
    for k, d in enumerate(device):
        i = bisect.bisect_left(ks, k)
        if i < len(ks) and ks[i] == k:
            out.append(prices[k])
        elif 0 < i < len(ks):
            lo, hi = ks[i - 1], ks[i]
            out.append(prices[lo] + (prices[hi] - prices[lo]) * (k - lo) / (hi - lo))
        elif i:
            out.append(max(d, prices[ks[-1]] + d - device[ks[-1]]))
        else:
            out.append(d)
    return out


class StepClock:
    """Times the engine's steps for DraftLengthPolicy.observe_step: `begin` at every step call, `end`
    with the (sequences, k) of the pure decode step the call launched (None: nothing, or a step with
    prompt chunks). `end` returns a sample (sequences, k, period) of the call before, its period
    entry to entry, when the launches whose work that call did all ran the same k: with overlap,
    call N collects step N - 1 (which verified what step N - 2 proposed: its tokens to emit,
    detokenize and check) and launches step N (verifying step N - 1's drafts), so
    k_{N-2} = k_{N-1} = k_N, with decode launches only in between. A sample taken right after a
    change of k priced the new k by the old k's work: in the SmolLM2 runs of 2026-11-27 the policy's
    k = 0, entered from k = 5 probes, was priced at 3.82 ms where fixed k = 0 ran 2.94 (batch 32,
    temperature 1), so k = 0 lost to k = 5 where it was the best mode. (Without overlap call N
    collects step N itself: the same rule is then one launch stricter than needed.)"""

    STEADY = 3  # consecutive launches at one k before a call's sample counts

    def __init__(self):
        self._entry = 0.0
        self._last: tuple[float, int, int] | None = None  # (entry, sequences, k) of the last launch
        self._ks: deque[int] = deque(maxlen=self.STEADY)  # k of the latest consecutive decode launches

    def begin(self) -> None:
        self._entry = time.perf_counter()

    def end(self, launched: tuple[int, int] | None) -> tuple[int, int, float] | None:
        last, self._last = self._last, None
        if launched is None:
            self._ks.clear()
            return None
        steady = len(self._ks) == self.STEADY and len(set(self._ks)) == 1  # k_{N-2}, k_{N-1}, k_N of the call before
        self._ks.append(launched[1])
        self._last = (self._entry, *launched)
        if last is None or not steady:
            return None
        return last[1], last[2], self._entry - last[0]
