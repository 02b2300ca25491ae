"""ci/profile_tables.py on a hand-written Chrome trace (the format LLMEngine.stop_profile writes):
device busy time is the union of kernel and copy intervals, host events are ignored, copies are
counted apart from kernels, and kernels are ranked by device time a step."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ci"))
from profile_tables import trace_kernel_table  # noqa: E402


def test_trace_kernel_table_counts_the_union_of_device_intervals(tmp_path):
    events = [
        dict(ph="X", cat="kernel", name="gemv", ts=0.0, dur=10.0),
        dict(ph="X", cat="kernel", name="norm", ts=5.0, dur=15.0),  # overlaps gemv: busy 0..20
        dict(ph="X", cat="gpu_memcpy", name="Memcpy DtoH", ts=30.0, dur=5.0),
        dict(ph="X", cat="kernel", name="gemv", ts=36.0, dur=4.0),
        dict(ph="X", cat="cpu_op", name="aten::linear", ts=0.0, dur=100.0),  # host: not device time
        dict(ph="i", cat="kernel", name="marker", ts=50.0),  # not a complete event
    ]
    path = tmp_path / "rank0.trace.json"
    path.write_text(json.dumps(dict(traceEvents=events)))
    table = trace_kernel_table(str(path), steps=2)
    assert table["gpu_span_ms_per_step"] == pytest.approx(40e-3 / 2)
    assert table["gpu_busy_ms_per_step"] == pytest.approx(29e-3 / 2)
    assert table["gpu_idle_fraction"] == pytest.approx(11 / 40)
    assert table["kernels_per_step"] == 1.5 and table["copies_per_step"] == 0.5
    assert [(k["name"], k["us_per_step"], k["calls_per_step"]) for k in table["top_kernels"]] == [
        ("norm", 7.5, 0.5), ("gemv", 7.0, 1.0)]
