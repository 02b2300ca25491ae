"""A decode step's host work grows slowly with the batch (~10 s on 2 cores).

A small model at a large batch is bound by the host's time per step, most of it Python calls
made once per sequence (docs/benchmarks.md, sections 8 and 11). ci/bench_host_sampling.py
counts the calls of LLMEngine.step made outside the model's forward (what a GPU's decode graphs
leave to the host), here at batches 8 and 24 with a real tokenizer, so detokenization counts
too. The calls each sequence adds were ~130 (78 without a tokenizer) and are ~37 since the
scheduler, step inputs, outputs and detokenizer work in bulk or without Python wrappers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_CALLS_PER_SEQ = 45


def test_decode_step_python_calls_per_sequence(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "ci" / "bench_host_sampling.py"), "--batches", "8,24", "--ks", "0",
                    "--temperatures", "0", "--warm", "1", "--steps", "2",
                    "--tokenizer", str(ROOT / "atom_like" / "zoo" / "models" / "tiny-kimi")],
                   env=env, check=True, timeout=300)
    small, large = json.loads((tmp_path / "host_sampling.json").read_text())
    per_seq = (large["engine_calls"] - small["engine_calls"]) / (large["batch"] - small["batch"])
    assert 0 < per_seq < MAX_CALLS_PER_SEQ, (
        f"{per_seq:.1f} Python calls per sequence per decode step: {small['engine_calls']} at batch 8, "
        f"{large['engine_calls']} at 24")
