"""ci/bench_adaptive.py --smoke: the benchmark's whole path (dummy-weight Llama target and EAGLE3
draft, forced acceptance, the plain engine, fixed-k and adaptive policies swapped on one engine,
the JSON / markdown / PNG) on a tiny fp32 model on CPU. ~30 s."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ci"))
import bench_adaptive  # noqa: E402


def test_smoke_writes_every_point(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    out = bench_adaptive.main(["--smoke"])
    rows = out["forced"]
    # batches 1, 4 x forced m 0..2 x (no speculation, k=1, k=2, adaptive)
    assert len(rows) == 2 * 3 * 4 and all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    for r in rows:
        if r["mode"].startswith("k="):
            assert r["mean_k"] == int(r["mode"][2:])
            assert r["mean_acceptance_length"] == 1 + min(r["forced"], r["mean_k"])  # forced acceptance holds
    # the policy follows the forced acceptance: no drafts when none is accepted, all of them when all are
    adaptive = {(r["batch"], r["forced"]): r["mean_k"] for r in rows if r["mode"] == "adaptive"}
    assert adaptive[1, 0] == 0 and adaptive[1, 2] == 2
    assert len(out["forced_verdicts"]) == 6
    assert json.loads((tmp_path / "bench_adaptive.json").read_text())["meta"]["k"] == 2
    assert "adaptive / best fixed" in (tmp_path / "bench_adaptive.md").read_text()
    assert (tmp_path / "bench_adaptive.png").stat().st_size > 0


def test_smoke_samek_same_work_at_the_same_k(tmp_path, monkeypatch):
    """The host-overhead check: at the same k the adaptive policy's steps do the fixed k's device
    work (the same torch ops, no host read, no eager step), and a pattern through k = 0 stays on
    the static path. ~10 s."""
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(bench_adaptive, "resolve_zoo_pair", lambda: "not in this test")  # the tiny shape alone, cached pair or not
    rows = bench_adaptive.main(["--smoke", "--parts", "samek"])["samek"]
    modes = {r["mode"]: r for r in rows}
    assert modes.keys() == {"fixed", "pinned", "zero"}
    assert modes["fixed"]["k_steps"] == modes["pinned"]["k_steps"] == {2: 4} and modes["zero"]["k_steps"] == {0: 2, 2: 2}
    assert all(r["eager_steps"] == 0 and r["host_reads_per_step"] == 0 for r in rows)
    assert modes["fixed"]["ops_per_step"] == modes["pinned"]["ops_per_step"]
    assert 0 < modes["pinned"]["python_calls_per_step"] - modes["fixed"]["python_calls_per_step"] < 200  # the policy's own
    assert "pinned / fixed" in (tmp_path / "bench_adaptive.md").read_text()
