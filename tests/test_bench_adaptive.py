"""ci/bench_adaptive.py --smoke: the benchmark's whole path (dummy-weight Llama target and EAGLE3
draft, forced acceptance, the plain engine, fixed-k and adaptive policies taking turns on one
running batch, the JSON / markdown / PNG) on a tiny fp32 model on CPU. ~30 s."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ci"))
import bench_adaptive  # noqa: E402
import bench_adaptive_report  # noqa: E402


def test_smoke_writes_every_point(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    # two more policies: this tree's own policy file, as an A/B run loads a saved one (the second
    # unnamed: adaptive-c)
    policy_b = str(Path(__file__).resolve().parents[1] / "spec_decode" / "adaptive.py")
    out = bench_adaptive.main(["--smoke", "--policy-b", policy_b, "--policy-b-name", "same", "--policy-b", policy_b])
    rows = out["forced"]
    # batches 1, 4 x forced m 0..2 x (plain engine, k=0, k=1, k=2, adaptive, adaptive-same, adaptive-c)
    assert len(rows) == 2 * 3 * 7 and all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert all(len(r["round_tokens_per_s"]) == 2 and r["eager_steps"] == 0 for r in rows)  # --smoke: 2 turns a mode
    assert all(r["mean_k"] == 0 and r["vs_k0_same_context"] > 0 for r in rows if r["mode"] == "off")
    for r in rows:
        if r["mode"].startswith("k="):
            assert r["mean_k"] == int(r["mode"][2:])
            assert r["mean_acceptance_length"] == 1 + min(r["forced"], r["mean_k"])  # forced acceptance holds
    # the policy follows the forced acceptance: no drafts when none is accepted, all of them when all are
    # (each adaptive policy learns from the steps it chose alone, the other modes' turns between them)
    for mode in ("adaptive", "adaptive-same", "adaptive-c"):
        adaptive = {(r["batch"], r["forced"]): r["mean_k"] for r in rows if r["mode"] == mode}
        assert adaptive[1, 0] == 0 and adaptive[1, 2] == 2
    # each adaptive policy logs its changes of k with the step times and expected acceptance it chose by:
    # the k logged is the one with the highest rate (1 + E[accepted | k]) / T(k) (the smallest k of a tie)
    for r in rows:
        if r["mode"].startswith("adaptive"):
            log = r["choices"]
            assert log and all(a[1] != b[1] for a, b in zip(log, log[1:]))  # changes only
            for _, k, times, gain in log:
                assert len(times) == len(gain) == 3
                rates = [(1 + g) / t for g, t in zip(gain, times)]
                assert rates.index(max(rates)) == k or rates[k] >= max(rates) * (1 - 1e-3)  # (rounded values)
        else:
            assert "choices" not in r
    assert len(out["forced_verdicts"]) == 6 * 3
    assert json.loads((tmp_path / "bench_adaptive.json").read_text())["meta"]["k"] == 2
    text = (tmp_path / "bench_adaptive.md").read_text()
    assert "adaptive: mean k, / no spec, / best fixed" in text and "Worst point of adaptive-same" in text
    assert "Worst point of adaptive-c" in text
    assert "| plain / k=0 |" in text
    assert (tmp_path / "bench_adaptive.png").stat().st_size > 0
    # the same result split by batch over two "calls" and merged: the same verdicts; a point twice is refused
    saved = json.loads((tmp_path / "bench_adaptive.json").read_text())
    calls = [{**saved, "forced": [r for r in rows if r["batch"] == b]} for b in (1, 4)]
    calls[0]["meta"] = {k: v for k, v in saved["meta"].items() if k != "forced_step_costs"}  # the other call's
    merged_dir = tmp_path / "merged"
    bench_adaptive_report.main(["merge", *(str(_dump(tmp_path / f"call{i}.json", c)) for i, c in enumerate(calls)),
                                "--out", str(merged_dir)])
    merged = json.loads((merged_dir / "bench_adaptive.json").read_text())
    assert merged["forced_verdicts"] == json.loads(json.dumps(out["forced_verdicts"])) and len(merged["meta"]["calls"]) == 2
    assert merged["meta"]["forced_step_costs"] == saved["meta"]["forced_step_costs"]
    with pytest.raises(ValueError, match="more than one result"):
        bench_adaptive_report.merge([calls[0], calls[0]])
    # calls that ran different --policy-b modes: a mode a point lacks is "-" in its row
    calls[1]["forced"] = [r for r in calls[1]["forced"] if r["mode"] != "adaptive-c"]
    bench_adaptive_report.main(["merge", *(str(_dump(tmp_path / f"call{i}.json", c)) for i, c in enumerate(calls)),
                                "--out", str(merged_dir)])
    rows_b4 = [line for line in (merged_dir / "bench_adaptive.md").read_text().splitlines() if line.startswith("| 4 |")]
    assert len(rows_b4) == 3 and all(line.count(" - |") == 3 for line in rows_b4)  # tokens/s, and the two verdict cells


def _dump(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


class _Recorder(bench_adaptive.DraftLengthPolicy):
    def __init__(self, k: int):
        self.max_drafts, self.k, self.chosen, self.seen, self.steps = k, k, [], [], []

    def choose(self, step: int, num_seqs: int) -> int:
        self.chosen.append(step)
        return self.k

    def observe(self, step: int, drafted: list[int], accepted: list[int]) -> None:
        self.seen.append((step, drafted, accepted))

    def observe_step(self, num_seqs: int, k: int, period_seconds: float) -> None:
        self.steps.append(k)


def test_rotation_numbers_each_policy_by_its_own_steps():
    """Turns of two policies on one engine: each sees its own steps numbered 0, 1, 2 ... and the
    verifications of those steps only, whenever they arrive; step samples skip a turn's first two."""
    a, b = _Recorder(1), _Recorder(2)
    rotation = bench_adaptive.Rotation({"a": a, "b": b})
    engine_step = 0
    for mode, steps in (("a", 3), ("b", 3), ("a", 3)):
        rotation.switch(mode)
        for _ in range(steps):
            assert rotation.choose(engine_step, 4) == {"a": 1, "b": 2}[mode]
            rotation.observe(engine_step - 1, [9], [9])  # the step before's verification (the one in flight)
            rotation.observe_step(4, 7, 1.5)
            engine_step += 1
    assert a.chosen == [0, 1, 2, 3, 4, 5] and b.chosen == [0, 1, 2]
    # engine steps 2 (a), 5 (b) arrive in the other's turn and still go to their chooser; step -1 is nobody's
    assert [s for s, _, _ in a.seen] == [0, 1, 2, 3, 4] and [s for s, _, _ in b.seen] == [0, 1, 2]
    assert len(a.steps) == 2 and len(b.steps) == 1  # 3 steps a turn, the first 2 of each skipped


def test_zoo_part_runs_small_batches_as_several_batches(tmp_path, monkeypatch):
    """The zoo part's path on the shipped tiny-kimi pair (random prompts): below --zoo-min-seqs a
    point runs that many sequences' worth of batches in turn, and at least --zoo-sets batches, each
    its own turns, pooled."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(bench_adaptive, "resolve_zoo_pair",
                        lambda: tuple(str(Path(__file__).resolve().parents[1] / "atom_like/zoo/models" / name)
                                      for name in ("tiny-kimi", "tiny-kimi-eagle3-mla")))
    monkeypatch.setattr(bench_adaptive, "zoo_prompts", lambda engine, n: bench_adaptive.random_prompts(min(n, 5), 8, 1000, 0))
    out = bench_adaptive.main(["--parts", "zoo", "--k", "2", "--batches", "1,2,4", "--zoo-min-seqs", "2", "--zoo-rounds",
                               "2", "--zoo-window", "2", "--warm", "2", "--settle", "1", "--adaptive-warm", "2",
                               "--zoo-sets", "2"])
    turns = {(r["batch"], r["temperature"], r["mode"]): len(r["round_tokens"]) for r in out["zoo"]}
    assert len(turns) == 3 * 2 * 5  # batches x temperatures x (plain, k = 0..2, adaptive)
    # 2 turns a batch of prompts; at batch 1 min-seqs' 2 batches, from 2 on --zoo-sets' 2 (at 4 the 5 prompts cycle)
    assert all(n == 4 for (batch, _, mode), n in turns.items() if mode != "off")
    assert all(r["tokens_per_s"] > 0 for r in out["zoo"]) and len(out["zoo_verdicts"]) == 6


def test_paired_interval_holds_the_paired_ratio_and_narrows_with_pairs():
    """The 95% interval of a paired ratio: around the median pair ratio, of zero width for one mode
    against itself, and narrower with four times the pairs (the same spread of ratios)."""
    import random

    def row(tokens, seconds):
        return {"round_tokens": tokens, "round_tokens_per_s": [t / s for t, s in zip(tokens, seconds)]}

    def rows(pairs, seed):
        rng = random.Random(seed)
        tokens = [rng.randint(5, 12) for _ in range(2 * pairs)]
        a_sec = [0.01 * rng.uniform(0.8, 1.2) for _ in tokens]
        b_sec = [s * rng.uniform(0.7, 1.3) for s in a_sec]  # pair ratios spread by about +-30%
        return row(tokens, a_sec), row(tokens, b_sec)

    a, b = rows(24, 0)
    low, high = bench_adaptive_report.paired_interval(a, b)
    assert low < bench_adaptive_report.paired(a, b) < high and high - low > 0.02
    assert bench_adaptive_report.paired_interval(a, a) == (1.0, 1.0)
    wide = high - low
    low, high = bench_adaptive_report.paired_interval(*rows(96, 0))
    assert high - low < 0.75 * wide


def test_policy_host_bench_runs():
    """ci/bench_policy_host.py: the policy's calls timed at batch 1 and 32, k = 0 and 3."""
    import bench_policy_host

    rows = bench_policy_host.main(["--steps", "200"])
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 0), (1, 3), (32, 0), (32, 3)]
    assert all(0 < r["choose_us"] < 1e4 and 0 < r["observe_step_us"] < 1e4 for r in rows)


def test_forced_points_that_outgrow_the_pool_are_known_before_they_run():
    """The 8B forced part on an H100 (2026-11-27) with a second adaptive policy: the KV pool held 274,320
    tokens and batch 128 preempted requests at m = 4 after minutes of turns. The estimate says so up front
    (m = 3 fits, m = 4 and 5 do not), and with one adaptive policy every m fits, as every earlier run did."""
    import argparse

    args = argparse.Namespace(warm=6, rounds=6, settle=3, window=6, adaptive_warm=30)  # the defaults
    need = {n: [128 * (64 + bench_adaptive.forced_tokens(args, 5, m, n)) for m in range(6)] for n in (1, 2)}
    assert max(need[1]) <= 274_320 and need[2][3] <= 274_320 < need[2][4]


def test_replay_reconstructs_the_recorded_fixed_modes():
    """ci/replay_adaptive.py on a recorded GPU zoo run (batch 8, T = 0): each fixed k replayed from the
    rounds' costs and the fitted acceptance comes within 10% of what the GPU measured for it, and the
    policy's paired ratios are the benchmark's kind of numbers."""
    import replay_adaptive

    path = Path(__file__).resolve().parents[1] / "docs" / "data" / "bench_adaptive_h100_merge_b1_8.json"
    run = json.loads(path.read_text())
    point = replay_adaptive.replay_point(run, 8, 0.0, {"adaptive": replay_adaptive.AdaptiveDraftLength}, 1, [run])
    for mode, replayed in point["replayed_fixed"].items():
        assert replayed == pytest.approx(point["measured"][mode], rel=0.10), mode
    ratios = point["policies"]["adaptive"]
    assert 1.1 < ratios["vs_off"] < 1.6 and 0.8 < ratios["vs_best"] <= 1.05, ratios
