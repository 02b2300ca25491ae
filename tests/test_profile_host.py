"""ci/profile_host.py runs end to end on the zoo's tiny-kimi pair (a few seconds on a CPU)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ci"))

import profile_host  # noqa: E402


def test_profile_host_smoke(tmp_path):
    out = tmp_path / "rows.json"
    rows = profile_host.main(["--batch", "4", "--ks", "0,2", "--temperatures", "0,1", "--warm", "1", "--steps", "2",
                              "--profile-steps", "1", "--top", "3", "--out", str(out)])
    assert [(r["k"], r["temperature"]) for r in rows] == [(0, 0.0), (2, 0.0), (0, 1.0), (2, 1.0)]
    for r in rows:
        assert r["step_ms"] > 0 and r["model_ms"] > 0 and r["host_ms"] > 0 and r["functions"] and r["builtins"]
        assert r["ops_per_step"] == sum(r["ops_by_place"].values()) and r["ops_by_place"]["sampler"] > 0
    # drafting adds the draft's inputs (the CPU path's torch version of kernels_rocm.step_advance.draft_starts)
    assert "draft inputs" not in rows[0]["ops_by_place"] and rows[1]["ops_by_place"]["draft inputs"] > 0
    assert json.loads(out.read_text()) == rows
