"""What a decode step costs (spec_decode/step_costs.py): the device profile's on-disk cache, the
observed periods' prices, and the clock that samples steady decode steps. The policy that reads
them is tested in tests/test_adaptive_policy.py."""
from __future__ import annotations

import pytest

from spec_decode.step_costs import StepClock, StepCosts, StepTimes, anchored


def test_costs_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_LIKE_SPEC_COSTS_DIR", str(tmp_path))
    key = dict(model="m", device="d", k=2)
    assert StepCosts.load(key) is None
    costs = StepCosts([1, 8], [[1.0, 1.2, 1.5], [2.0, 2.6, 3.4]], "measured on d")
    costs.save(key)
    back = StepCosts.load(key)
    assert (back.buckets, back.seconds) == (costs.buckets, costs.seconds) and back.source.startswith("cache ")
    assert StepCosts.load(dict(key, k=3)) is None
    assert back.step_times(5)[1] == 2.6 and back.step_times(16)[2] == pytest.approx(6.8)  # bucket 8; past it, scaled


def test_step_times_quartiles_and_caps():
    times = StepTimes([1, 8])
    assert times.observed(1) == {}
    for t in (9.0, 1.2, 8.0):  # one-sided noise (a compile, a slow phase): the lower quartile ignores it
        times.observe(1, 2, t)
    assert times.observed(1) == {2: 1.2}
    for t in (1.0, 1.5, 2.3, 9.5, 9.5):  # the slow phase the policy left k = 2 in does not price it
        times.observe(1, 2, t)
    assert times.observed(1) == {2: 1.2} and times.observed(8) == {}  # another bucket
    times.observe(1, 7, 100.0)  # fewer than MIN_SAMPLES: not priced
    assert 7 not in times.observed(1)
    for _ in range(3):
        times.observe(1, 4, 6.0)  # far above k = 2: capped at OUTLIER^2 times its price
    assert times.observed(1)[4] == pytest.approx(1.2 * StepTimes.OUTLIER ** 2)
    for _ in range(StepTimes.WINDOW):  # the last WINDOW samples only
        times.observe(1, 2, 1.8)
    assert times.observed(1)[2] == 1.8


def test_step_times_hand_back_the_same_prices_until_one_moves():
    """The policy keeps T(batch, k) worked out from a prices dict for as long as observed() hands back
    that same dict (AdaptiveDraftLength.step_times): a new dict exactly when a price moved."""
    times = StepTimes([1, 8])
    for t in (1.0, 2.0, 3.0):
        times.observe(1, 2, t)
    first = times.observed(1)
    times.observe(1, 2, 4.0)  # the lower quartile of 1..4 is still 1.0
    assert times.observed(1) is first
    times.observe(1, 2, 0.5)
    times.observe(1, 2, 0.5)
    assert times.observed(1) is not first and times.observed(1) == {2: 0.5} and first == {2: 1.0}
    second = times.observed(2)  # bucket 8
    times.observe(8, 1, 7.0)  # one sample: k = 1 not priced yet, so nothing moved
    assert times.observed(1) == {2: 0.5} and times.observed(2) is second


def test_anchored_guesses_from_the_priced_ks_and_the_profile():
    device = [1.0, 1.2, 1.6, 1.7, 1.8, 2.0]
    # above the priced ks the highest one moved by the profile (never below it); below them the profile alone
    assert anchored({2: 3.0}, device) == pytest.approx([1.0, 1.2, 3.0, 3.1, 3.2, 3.4])
    assert anchored({1: 1.1}, device) == pytest.approx([1.0, 1.1, 1.6, 1.7, 1.8, 2.0])
    # between two priced ks the line through them
    assert anchored({1: 5.0, 4: 8.0}, device) == pytest.approx([1.0, 5.0, 6.0, 7.0, 8.0, 8.2])


def test_step_clock_samples_steady_decode_periods(monkeypatch):
    """A call's sample counts when the launches whose work it did (the step it collects, verifying
    the drafts of the one before, and the step it launches) ran one k; a step with prompt chunks
    (None) starts the count again."""
    entries = [0.0, 10.0, 25.0, 31.0, 40.0, 52.0, 60.0, 75.0, 80.0, 90.0, 95.0, 99.0, 107.0]
    now = iter(entries)
    monkeypatch.setattr("spec_decode.step_costs.time.perf_counter", lambda: next(now))
    clock = StepClock()
    samples = []
    calls = [(4, 2), (4, 2), (4, 2), (4, 2), (4, 3), (4, 3), (4, 3), (4, 3), None, (4, 3), (4, 3), (4, 3), (4, 3)]
    for launched in calls:
        clock.begin()
        samples.append(clock.end(launched))
    # calls 2 and 3 ran after three launches at k = 2: (25 -> 31), (31 -> 40); call 4 launched
    # k = 3, and calls 5 and 6 still collect steps that verified k = 2 drafts; 6 -> 7 is steady at
    # k = 3; the prompt step (8) restarts the count: three more launches before a sample (11 -> 12)
    assert samples == [None, None, None, (4, 2, 6.0), (4, 2, 9.0), None, None, (4, 3, 15.0), None, None, None, None,
                       (4, 3, 8.0)]
