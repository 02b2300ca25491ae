"""ci/bench_host_sampling.py --smoke (~7 s on 2 cores): it runs, and the sampler blocks the host
nowhere, greedy or sampling, with or without a draft."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_host_sampling_smoke(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "ci" / "bench_host_sampling.py"), "--smoke"], env=env, check=True,
                   timeout=300)
    rows = json.loads((tmp_path / "host_sampling.json").read_text())
    assert {(r["k"], r["temperature"]) for r in rows} == {(0, 0.0), (0, 1.0), (1, 0.0), (1, 1.0)}
    assert all(r["sampler_blocking"] == 0 and r["sampler_torch"] > 0 for r in rows), rows
